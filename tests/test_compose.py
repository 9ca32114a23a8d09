"""The embedded engine as the composition root builds it: a random API key by default, secrets never on argv."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from titan_lora.compose import embedded_engine
from titan_lora.config import WeightSync


def _engine(tmp_path: Path, cfg):  # noqa: ANN001, ANN202
    return embedded_engine(cfg, str(tmp_path / "hf"), torch.device("cpu"), str(tmp_path), lora_rank=8)


@pytest.mark.parametrize("engine_kind", ["vllm", "receiver"])
def test_the_embedded_engine_gets_a_random_key_by_environment_only(tmp_path: Path, engine_kind: str) -> None:
    cfg = WeightSync(enabled=True, engine=engine_kind, engine_start_timeout_s=123.0, health_timeout_s=4.0)
    engines = [_engine(tmp_path, cfg) for _ in range(2)]
    try:
        keys = [e.api_key for e in engines]
        assert all(len(k) >= 32 for k in keys) and keys[0] != keys[1], "an empty api_key must become random"
        assert not any("--api-key" in e.args or e.api_key in e.args for e in engines)
        assert (engines[0].start_timeout_s, engines[0].health_timeout_s) == (123.0, 4.0)
        assert engines[0].port != engines[1].port, "each engine holds its own reserved port"
    finally:
        for e in engines:
            e.stop()


def test_a_configured_key_is_kept_and_stays_off_argv(tmp_path: Path) -> None:
    engine = _engine(tmp_path, WeightSync(enabled=True, api_key="s3cret-key"))
    try:
        assert engine.api_key == "s3cret-key" and not any("s3cret-key" in a for a in engine.args)
    finally:
        engine.stop()
