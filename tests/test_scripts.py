"""Every script under scripts/ imports against the package as it is now (a renamed or moved name breaks a
benchmark that CI never runs: bench_sync.py once imported `fill_param` from where it no longer was)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "scripts").glob("*.py"))


def test_every_script_is_listed():
    assert len(SCRIPTS) >= 15, [p.name for p in SCRIPTS]


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_the_script_imports(script: Path, monkeypatch):
    """Its module body runs (imports, constants, argument parser definitions); its main() does not."""
    source = script.read_text()
    assert source.count('if __name__ == "__main__":') == (0 if script.stem == "bench_timing" else 1), \
        f"{script.name}: its work must sit behind a __main__ guard"
    spec = importlib.util.spec_from_file_location(f"titan_lora_script_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    monkeypatch.syspath_prepend(str(script.parent))  # as `python scripts/X.py` has it (bench_timing)
    spec.loader.exec_module(module)
