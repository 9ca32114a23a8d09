"""The base goes to the engine one tensor at a time: rank 0 holds about one full tensor, the other
ranks keep nothing, names and bytes are what torchtitan's state-dict adapter gives for the whole model."""

from __future__ import annotations

import gc
import hashlib

import pytest
import torch
from dist_helpers import run_ranks
from model_helpers import StubBaseModel, StubSdAdapter
from syncer_helpers import build_syncer, expected_base, sync_cfg
from torch.distributed.tensor import DTensor

from titan_lora.sync.base_stream import base_weights_source
from titan_lora.transfer.errors import TransferError
from titan_lora.transfer.protocol import Ack


def digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes."""
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def retained_bytes(exclude: set[int]) -> int:
    """Bytes of every CPU tensor storage that Python objects reach, except storages in `exclude`
    (after a collection: a gather's result may sit in a reference cycle until the next one)."""
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not isinstance(obj, DTensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            if storage.data_ptr() and storage.data_ptr() not in exclude:
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def storages() -> set[int]:
    """The storages alive now (the model's shards, the gatherer's buffers, ...)."""
    return {o.untyped_storage().data_ptr() for o in gc.get_objects()
            if isinstance(o, torch.Tensor) and not isinstance(o, DTensor) and o.device.type == "cpu"}


class LazyEmitter:
    """Consumes the base stream one tensor at a time, keeping only each tensor's digest, and measures
    what rank 0 holds while it holds one tensor. Its first attempt fails after `fail_after` tensors."""

    def __init__(self, fail_after: int) -> None:
        self.fail_after = fail_after
        self.attempts = 0
        self.baseline: set[int] = set()
        self.digests: dict[str, str] = {}
        self.over: list[tuple[str, int, int]] = []  # (name, held bytes, that tensor's bytes)

    def engine_incarnation(self) -> str:
        return "fake-engine"

    def send_base(self, tensors, version: int) -> Ack:
        count = nbytes = 0
        self.attempts += 1
        for name, t in tensors:
            if self.attempts == 1 and count == self.fail_after:
                raise TransferError("the engine refused a bucket")  # stops consuming: the syncer drains
            size = t.numel() * t.element_size()
            self.over.append((name, retained_bytes(self.baseline), size))
            self.digests[name] = digest(t)
            count, nbytes = count + 1, nbytes + size
        return Ack(version, count, nbytes)

    def send_adapter(self, payload) -> Ack:
        return Ack(payload.version, payload.num_tensors, payload.nbytes)

    def retire_adapter(self, name: str, timeout_s: float) -> bool:
        return True

    def close(self) -> None:
        pass


def _stream(rank: int, world: int) -> None:
    built, syncer = build_syncer(rank, sync_cfg(), None, url="http://127.0.0.1:1")
    emitter = LazyEmitter(fail_after=3) if rank == 0 else None
    syncer.emitter, syncer.engine = emitter, None
    held_on_rank1: list[int] = []
    full_tensor = DTensor.full_tensor
    if rank == 1:  # before each gather: what the previous ones left behind on this rank
        DTensor.full_tensor = lambda self, *a, **k: (held_on_rank1.append(retained_bytes(baseline)),
                                                     full_tensor(self, *a, **k))[1]
    gc.collect()
    baseline = storages()
    if emitter is not None:
        emitter.baseline = baseline
    syncer.sync(1)
    DTensor.full_tensor = full_tensor
    after = retained_bytes(baseline)
    base = expected_base(built)  # collective oracle: the whole model through sd_adapter.to_hf
    total = sum(t.numel() * t.element_size() for t in base.values())
    if rank == 0:
        want = {n: digest(t) for n, t in base.items()}
        assert list(emitter.digests) == list(want) and emitter.digests == want
        assert "lm_head.weight" not in emitter.digests, "tied: the engine ties lm_head itself"
        assert syncer.counters["base_sends"] == 1 and emitter.attempts == 2, "one retry of the whole stream"
        worst = max(held - 2 * size for _, held, size in emitter.over)
        assert worst <= 64 * 2**10, f"rank 0 held more than one tensor (+ its permuted copy): {emitter.over}"
    else:
        assert len(held_on_rank1) == 2 * len(base), "rank 1 took part in every gather of both attempts"
        assert max(held_on_rank1) <= 64 * 2**10 < total, f"rank 1 kept gathered tensors: {held_on_rank1}"
    assert after <= 64 * 2**10, f"{after} bytes left behind after the base send"


def test_the_base_streams_one_tensor_at_a_time_other_ranks_keep_nothing_and_a_retry_reruns_it() -> None:
    run_ranks(2, _stream)


# ---- the stream in one process, on a stand-in model -------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_the_base_stream_yields_each_hf_weight_converted_and_skips_adapters_and_unmapped(tied: bool) -> None:
    model, sd = StubBaseModel(), StubSdAdapter()
    got = list(base_weights_source(model, sd, tied_embeddings=tied)())
    want = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if tied else ["lm_head.weight"])
    assert [n for n, _ in got] == want
    params = {"model.embed_tokens.weight": model.tok_embeddings.weight, "model.norm.weight": model.norm.weight,
              "lm_head.weight": model.lm_head.weight}
    for name, t in got:
        assert torch.equal(t, params[name].detach() * 2), "the converted tensor, not the param"
    # names are found on meta tensors of the param's shape, then each kept tensor is converted alone
    assert ("tok_embeddings.weight", torch.device("meta"), (4, 2)) in sd.seen
    assert ("freqs_cis", torch.device("meta"), (3,)) in sd.seen
    assert ("tok_embeddings.weight", torch.device("cpu"), (4, 2)) in sd.seen
    assert not any("lora" in name for name, _, _ in sd.seen)


@pytest.mark.parametrize("rank", [0, 1])
def test_under_a_process_group_only_rank_0_gets_the_base(monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    from titan_lora.sync import base_stream

    monkeypatch.setattr(base_stream.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(base_stream.dist, "get_rank", lambda: rank)
    sd = StubSdAdapter()
    got = list(base_stream.base_weights_source(StubBaseModel(), sd, tied_embeddings=False)())
    assert [n for n, _ in got] == (["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
                                   if rank == 0 else [])
    assert sum(device == torch.device("meta") for _, device, _ in sd.seen) == 4, "every rank maps every name"
