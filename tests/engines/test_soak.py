"""Soak (slow): 200 adapter syncs into one live vLLM engine with generate requests in flight the whole
time, through the real emitter, AdapterVersions and Retirer (`scripts/soak.py`; 1,000 syncs there)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.long]
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"


def _soak_module():
    spec = importlib.util.spec_from_file_location("titan_soak", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_200_syncs_under_load_hold_no_hang_no_growth_and_no_leftovers(smollm2_dir, tmp_path) -> None:
    soak = _soak_module()
    # RSS baseline at sync 50: by then the LRU, slab pool and slot layouts have reached steady state.
    result = soak.soak(str(smollm2_dir), syncs=200, keep_versions=2, rss_from=50, call_timeout_s=60,
                       log_path=tmp_path / "engine.log")
    print(result.to_json())
    assert result.hangs == 0 and not result.errors
    assert result.generate_calls > 0, "no generate request ran during the syncs"
    assert result.max_live <= 3 and result.max_engine_adapters <= 3
    assert result.rss_growth < 0.05, f"engine RSS {result.rss_start_mb:.0f} -> {result.rss_end_mb:.0f} MiB"
    assert result.shm_used and not result.shm_left
