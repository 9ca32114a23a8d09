"""A worker's record of the base it loaded (`engines/base_record.py`): each floating-point tensor's digest in
the engine's dtype, and nothing at all when the engine was told that nobody will ask (a push job)."""

from __future__ import annotations

import pytest
import torch

from titan_lora.engines import base_record
from titan_lora.transfer.digest import tensor_digest


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base_record, "_digests", {})
    monkeypatch.setattr(base_record, "_loaded_dtype", None)


def test_a_recording_worker_keeps_each_tensors_digest_in_the_engines_dtype(fresh, monkeypatch) -> None:
    monkeypatch.setattr(base_record, "RECORDING", True)
    w = torch.randn(4, 3, dtype=torch.float64)
    base_record.record("model.norm.weight", w, torch.float32)
    base_record.record("model.layers.0.mlp.scale_idx", torch.arange(3), torch.float32)  # not a weight we send
    assert base_record.recorded() == {"dtype": "float32",
                                      "digests": {"model.norm.weight": tensor_digest("model.norm.weight",
                                                                                     w.float())}}


def test_a_worker_told_to_skip_digests_nothing_and_records_no_base(fresh, monkeypatch) -> None:
    monkeypatch.setattr(base_record, "RECORDING", False)
    monkeypatch.setattr(base_record, "tensor_digest", lambda *_: pytest.fail("digested a skipped tensor"))
    base_record.record("model.norm.weight", torch.randn(4), torch.float32)
    assert base_record.recorded() == {"dtype": None, "digests": {}}, "a verifying trainer then sends it all"
