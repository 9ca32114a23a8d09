"""Shared fixtures: the converted SmolLM2 checkpoint and small job configs.

Some modules need a package the GPU hosts (where `pytest -m gpu` runs) do not have: the live-engine modules
vLLM, the service's the tinker SDK, uvicorn and starlette, the agent episodes' the openai client. A host
without one leaves those modules out, and says so in the header, instead of failing to import them; on CPU,
tests/test_environment.py fails when any is missing, so the suite cannot pass without them.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from optional_packages import NEEDS  # tests/ on the path first
os.environ.setdefault("OMP_NUM_THREADS", "1")

MISSING = [name for name in NEEDS if importlib.util.find_spec(name) is None]
collect_ignore_glob = sorted({glob for name in MISSING for glob in NEEDS[name]})


def pytest_report_header(config: pytest.Config) -> str | None:
    """Say which modules were left out, and why."""
    if not MISSING:
        return None
    return (f"not installed: {', '.join(MISSING)}; left out: "
            f"{', '.join(f'tests/{glob}' for glob in collect_ignore_glob)}")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The HF safetensors copy of SmolLM2-135M-Instruct (converted from the GGUF once, then cached)."""
    from titan_lora.models.smollm2 import pretrained_dir

    return pretrained_dir()
