"""Shared fixtures: the converted SmolLM2 checkpoint and small job configs.

The live-engine modules (engines/test_vllm_*.py) need vLLM. A host without it (the GPU hosts, where
`pytest -m gpu` runs) leaves them out, and says so in the header, instead of failing to import them;
on CPU, tests/test_environment.py fails when vLLM is missing, so the suite cannot pass without them.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

HAS_VLLM = importlib.util.find_spec("vllm") is not None
collect_ignore_glob = [] if HAS_VLLM else ["engines/test_vllm_*.py"]


def pytest_report_header(config: pytest.Config) -> str | None:
    """Say which modules were left out, and why."""
    if HAS_VLLM:
        return None
    return "vLLM is not installed: tests/engines/test_vllm_*.py (live engines) are left out"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The HF safetensors copy of SmolLM2-135M-Instruct (converted from the GGUF once, then cached)."""
    from titan_lora.models.smollm2 import pretrained_dir

    return pretrained_dir()
