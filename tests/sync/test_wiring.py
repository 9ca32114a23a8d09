"""The embedded engine as wiring builds it: a random API key by default, secrets never on argv."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from syncer_helpers import sync_cfg

from titan_lora.sync.wiring import embedded_engine


def _run(tmp_path: Path) -> types.SimpleNamespace:
    cfg = types.SimpleNamespace(job=types.SimpleNamespace(dump_folder=str(tmp_path)),
                                lora=types.SimpleNamespace(rank=8))
    return types.SimpleNamespace(cfg=cfg, device=torch.device("cpu"),
                                 built=types.SimpleNamespace(hf_dir=str(tmp_path / "hf")))


@pytest.mark.parametrize("engine_kind", ["vllm", "receiver"])
def test_the_embedded_engine_gets_a_random_key_by_environment_only(tmp_path: Path, engine_kind: str) -> None:
    cfg = sync_cfg(engine=engine_kind, engine_start_timeout_s=123.0, health_timeout_s=4.0)
    engines = [embedded_engine(_run(tmp_path), cfg) for _ in range(2)]
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
    engine = embedded_engine(_run(tmp_path), sync_cfg(api_key="s3cret-key"))
    try:
        assert engine.api_key == "s3cret-key" and not any("s3cret-key" in a for a in engine.args)
    finally:
        engine.stop()
