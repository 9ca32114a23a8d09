"""The worker extension's bucket handling, without a model: each bucket is checked against the trainer's
checksum over the bytes it holds, and uncommitted adapter slabs go back to the pool when their
transfer is discarded or evicted."""

from __future__ import annotations

import uuid

import pytest
import torch

from titan_lora.engines import vllm_ext
from titan_lora.engines.transfers import ChecksumMismatch
from titan_lora.transfer.buckets import bucket_checksum, bucket_size, layout_id, pack, plan_buckets
from titan_lora.transfer.transport import BucketBuffer


@pytest.fixture
def ext():
    worker = vllm_ext.TitanLoRAWorkerExtension()
    worker.__dict__["_titan"] = vllm_ext._State()  # what _titan_state builds, minus vLLM's LoRA manager
    return worker


@pytest.fixture
def buffer():
    buf = BucketBuffer(1 << 16, torch.device("cpu"))
    yield buf
    buf.close()


def _send(ext, buf: BucketBuffer, transfer_id: str, seed: int, kind: str = "adapter",
          corrupt: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    tensors = {f"base_model.model.layers.0.self_attn.q_proj.lora_{ab}.weight": torch.randn(8, 16, generator=g)
               for ab in "AB"}
    (entries,) = plan_buckets(tensors, 1 << 20)
    pack(buf.tensor, entries, tensors)
    checksum = bucket_checksum(buf.tensor[: bucket_size(entries)])
    if corrupt:
        buf.tensor[3] ^= 0x5A
    return ext.titan_receive_bucket(transfer_id, buf.describe(), layout_id(entries),
                                    [e.to_json() for e in entries], kind, checksum)


def _free_slabs(ext) -> int:
    return sum(len(free) for free in ext._titan_state().slabs._free.values())


def test_an_adapter_bucket_ack_carries_the_checksum_of_its_slab(ext, buffer) -> None:
    transfer_id = uuid.uuid4().hex
    ack = _send(ext, buffer, transfer_id, seed=1)
    (staged_id,) = ext._titan_state().transfers._staged
    slab_data = ext._titan_state().transfers._staged[staged_id].held[0][1].data
    assert ack["checksum"] == bucket_checksum(slab_data) and (ack["tensors"], ack["bytes"]) == (2, 2 * 8 * 16 * 4)


def test_a_corrupted_bucket_discards_its_transfer_and_frees_its_slabs(ext, buffer) -> None:
    transfer_id = uuid.uuid4().hex
    _send(ext, buffer, transfer_id, seed=2)
    with pytest.raises(ChecksumMismatch, match="checksum mismatch"):
        _send(ext, buffer, transfer_id, seed=3, corrupt=True)
    assert ext._titan_state().transfers.pending() == {}
    assert _free_slabs(ext) == 2, "both slabs of the discarded transfer must return to the pool"
    with pytest.raises(ValueError, match="has no buckets"):
        ext._titan_state().transfers.take(transfer_id)


def test_abandoned_adapter_transfers_are_evicted_and_their_slabs_reused(ext, buffer, monkeypatch) -> None:
    pool = ext._titan_state().slabs
    taken: list[int] = []
    take = pool.take
    monkeypatch.setattr(pool, "take", lambda *a: taken.append(id(s := take(*a))) or s)
    for seed in range(6):  # six adapter transfers that never commit, then two bases
        _send(ext, buffer, uuid.uuid4().hex, seed)
    for seed in range(2):
        _send(ext, buffer, uuid.uuid4().hex, seed, kind="base")
    assert ext._titan_state().transfers.pending() == {"adapter": 2, "base": 1}
    assert len(taken) == 6 and len(set(taken)) == 2, "an evicted transfer's slab must be reused"
