"""The vLLM bucket emitter against an engine that really reads the bytes with realistic delays: buckets
in order with the commit on the last, every tensor intact through the double buffer, nothing more
posted once a bucket failed, and wrong content or counts in an ack refused."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator

import pytest
import torch
from reading_engine import ReadingEngine

from titan_lora.clients.base import AdapterPayload
from titan_lora.clients.vllm import VLLMBucketEmitter
from titan_lora.transfer.errors import TransferError
from titan_lora.transfer.transport import home_of, shared_tensor

TENSOR_BYTES = 64 * 1024 * 4
Make = Callable[..., VLLMBucketEmitter]  # the emitter_for fixture


def _payload() -> AdapterPayload:
    g = torch.Generator().manual_seed(0)  # distinct values per tensor: a swapped or stale read shows
    tensors = {f"base_model.model.layers.{i}.q_proj.lora_A.weight": torch.randn(64, 1024, generator=g)
               for i in range(4)}
    return AdapterPayload("policy-v3", 3, tensors, {"r": 64, "lora_alpha": 64})


@pytest.fixture
def emitter_for() -> Iterator[Make]:
    made: list[VLLMBucketEmitter] = []

    def make(engine: ReadingEngine, bucket_bytes: int = 300 * 1024) -> VLLMBucketEmitter:
        emitter = VLLMBucketEmitter(engine, bucket_mb=1)
        emitter.bucket_bytes = bucket_bytes  # 300 KiB: each 256 KiB tensor in its own bucket
        made.append(emitter)
        return emitter

    yield make
    for emitter in made:
        emitter.close()


def test_every_tensor_arrives_intact_and_the_commit_rides_on_the_last_bucket(emitter_for: Make) -> None:
    engine = ReadingEngine(delay_s=0.02)  # the packer runs ahead while the engine copies slowly
    payload = _payload()
    ack = emitter_for(engine).send_adapter(payload)
    assert (ack.version, ack.num_tensors, ack.nbytes) == (3, 4, 4 * TENSOR_BYTES)
    assert ack.phases_ms["buckets"] == 4 and ack.phases_ms["checksum_ms"] >= 0
    assert ["commit" in b for b in engine.bodies] == [False, False, False, True]
    assert engine.bodies[-1]["commit"]["name"] == "policy-v3"
    got = engine.adapters["policy-v3"]
    assert list(got) == list(payload.tensors)
    for name, sent in payload.tensors.items():  # a buffer repacked before its copy-out breaks these
        assert torch.equal(got[name], sent), f"{name} arrived with another bucket's bytes"


@pytest.mark.parametrize("failing", [0, 1, 2])
def test_after_a_failed_bucket_no_later_bucket_and_no_commit_is_sent(emitter_for: Make, failing: int) -> None:
    engine = ReadingEngine(delay_s=0.02, fail=frozenset({failing}))
    with pytest.raises(TransferError, match=f"engine said no to bucket {failing}"):
        emitter_for(engine).send_adapter(_payload())
    assert len(engine.bodies) == failing + 1, "buckets after the failed one were still posted"
    assert not any("commit" in b for b in engine.bodies) and engine.adapters == {}


def test_an_engine_misreading_two_tensors_with_right_counts_fails_the_checksum(emitter_for: Make) -> None:
    names = list(_payload().tensors)
    engine = ReadingEngine(delay_s=0.02, misread=frozenset(names[1:3]))
    with pytest.raises(TransferError, match="checksum mismatch in bucket 1 of the adapter transfer"):
        emitter_for(engine).send_adapter(_payload())
    assert not any("commit" in b for b in engine.bodies), "the adapter was committed after a bad bucket"


def test_a_misread_inside_one_bucket_is_caught_too(emitter_for: Make) -> None:
    payload = _payload()
    engine = ReadingEngine(delay_s=0.02, misread=frozenset(list(payload.tensors)[2:]))
    with pytest.raises(TransferError, match="checksum mismatch in bucket 0"):
        emitter_for(engine, bucket_bytes=4 * TENSOR_BYTES).send_adapter(payload)


def test_an_engine_without_checksums_is_refused(emitter_for: Make) -> None:
    with pytest.raises(TransferError, match="the engine does not checksum"):
        emitter_for(ReadingEngine(delay_s=0, checksums=False)).send_adapter(_payload())


def test_bucket_posts_carry_the_checksum_of_the_bytes_sent(emitter_for: Make) -> None:
    from titan_lora.transfer.buckets import bucket_checksum

    engine = ReadingEngine(delay_s=0)
    payload = _payload()
    emitter_for(engine).send_adapter(payload)
    for body, sent in zip(engine.bodies, payload.tensors.values()):  # one tensor per bucket, at offset 0
        assert body["checksum"] == bucket_checksum(sent.view(-1).view(torch.uint8))


@pytest.mark.parametrize("kind", ["adapter", "base"])
def test_a_wrong_tensor_count_in_an_ack_raises(emitter_for: Make, kind: str) -> None:
    engine = ReadingEngine(delay_s=0, count_error=-1)
    emitter = emitter_for(engine)
    with pytest.raises(TransferError, match=r"acknowledged 0 tensors / 1048576 bytes .* but 4 / 1048576 were"):
        if kind == "adapter":
            emitter.send_adapter(_payload())
        else:
            emitter.send_base(_payload().tensors, version=1)


def _tracked(sizes: list[int], produced: list[tuple[str, weakref.ref]], engine: ReadingEngine,
             posted_at: list[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """Fresh tensors (as a gather makes them), recording which earlier ones are still alive."""
    for i, numel in enumerate(sizes):
        t = torch.arange(numel, dtype=torch.float32) + 1000 * i
        produced.append((f"model.layers.{i}.weight", weakref.ref(t)))
        posted_at.append(len(engine.bodies))
        yield produced[-1][0], t
        del t


def test_send_base_packs_a_generator_as_it_goes_and_holds_no_tensor(emitter_for: Make) -> None:
    engine = ReadingEngine(delay_s=0.005)
    sizes = [16 * 1024] * 12 + [200 * 1024] + [16 * 1024] * 4  # 64 KiB each, and one 800 KiB > a bucket
    produced: list[tuple[str, weakref.ref]] = []
    posted_at: list[int] = []
    alive_at_yield: list[int] = []

    def watched() -> Iterator[tuple[str, torch.Tensor]]:
        for item in _tracked(sizes, produced, engine, posted_at):
            alive_at_yield.append(sum(ref() is not None for _, ref in produced[:-1]))
            yield item

    ack = emitter_for(engine, bucket_bytes=256 * 1024).send_base(watched(), version=5)
    assert (ack.version, ack.num_tensors, ack.nbytes) == (5, len(sizes), 4 * sum(sizes))
    assert max(alive_at_yield) == 0, "the emitter kept earlier base tensors alive"
    # Buckets: 3 of four 64 KiB tensors, the large one alone, then the last four. Buffer reuse and the
    # regrowth for the large tensor wait for acks, so the first three reached the engine before the end.
    assert posted_at[-1] >= 3, "the generator was drained before the buckets were posted"
    for i, numel in enumerate(sizes):
        want = torch.arange(numel, dtype=torch.float32) + 1000 * i
        assert torch.equal(engine.base[f"model.layers.{i}.weight"], want), f"base tensor {i} changed"


def test_a_failed_base_bucket_stops_the_base_transfer(emitter_for: Make) -> None:
    engine = ReadingEngine(delay_s=0.02, fail=frozenset({1}))
    with pytest.raises(TransferError, match="engine said no to bucket 1"):
        emitter_for(engine).send_base(iter(_payload().tensors.items()), version=1)
    assert len(engine.bodies) == 2 and engine.base == {}


def test_tensors_already_in_shared_memory_go_in_place_with_their_checksum(emitter_for: Make) -> None:
    flat = shared_tensor(4 * 64 * 1024, torch.float32, torch.device("cpu"))  # as the gatherer writes it
    flat.copy_(torch.randn(flat.numel(), generator=torch.Generator().manual_seed(1)))
    payload = AdapterPayload("policy-v5", 5, {f"t{i}": flat[i * 65536 : (i + 1) * 65536] for i in range(4)},
                             {"r": 8, "lora_alpha": 8})
    engine = ReadingEngine(delay_s=0.005)
    emitter = emitter_for(engine)
    emitter.send_adapter(payload)
    buf, _ = home_of(flat)
    assert [b["segment"] for b in engine.bodies] == [buf.describe(k * TENSOR_BYTES) for k in range(4)]
    assert emitter._buffers == [], "no packing buffer is needed for tensors already in shared memory"
    assert all(torch.equal(engine.adapters["policy-v5"][n], t) for n, t in payload.tensors.items())
