"""Shared fixtures: the converted SmolLM2 checkpoint and small job configs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The HF safetensors copy of SmolLM2-135M-Instruct (converted from the GGUF once, then cached)."""
    from titan_lora.models.smollm2 import pretrained_dir

    return pretrained_dir()
