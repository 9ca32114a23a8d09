"""The vLLM bucket emitter against an engine that really reads the bytes with realistic delays: buckets
in order with the commit on the last, every tensor intact through the double buffer, nothing more
posted once a bucket failed, and wrong content or counts in an ack refused."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterator

import pytest
import torch
from reading_engine import ReadingEngine

from titan_lora.clients.base import AdapterPayload
from titan_lora.clients.vllm import VLLMBucketEmitter
from titan_lora.transfer.errors import TransferError
from titan_lora.transfer.protocol import EngineLimits
from titan_lora.transfer.transport import lend_buffer

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
    flat, buf = lend_buffer(4 * 64 * 1024, torch.float32, torch.device("cpu"))  # as the gatherer writes it
    flat.copy_(torch.randn(flat.numel(), generator=torch.Generator().manual_seed(1)))
    tensors = {f"t{i}": flat[i * 65536 : (i + 1) * 65536] for i in range(4)}
    payload = AdapterPayload("policy-v5", 5, tensors, {"r": 8, "lora_alpha": 8}, home=buf)
    engine = ReadingEngine(delay_s=0.005)
    emitter = emitter_for(engine)
    emitter.send_adapter(payload)
    assert [b["segment"] for b in engine.bodies] == [buf.describe(k * TENSOR_BYTES) for k in range(4)]
    assert emitter._buffers == [], "no packing buffer is needed for tensors already in shared memory"
    assert all(torch.equal(engine.adapters["policy-v5"][n], t) for n, t in payload.tensors.items())
    # The same tensors without the buffer named in the payload are packed: nothing is looked up.
    engine.bodies.clear()
    emitter.send_adapter(AdapterPayload("policy-v6", 6, tensors, {"r": 8, "lora_alpha": 8}))
    assert all(b["segment"]["name"] != buf.describe()["name"] for b in engine.bodies) and emitter._buffers
    assert all(torch.equal(engine.adapters["policy-v6"][n], t) for n, t in tensors.items())


def test_several_adapters_in_the_lent_buffer_are_planned_as_one_bucket_whatever_bucket_mb(emitter_for: Make) -> None:
    """Several adapters gathered together into the lent buffer (`send_adapters`): one bucket from where they lie,
    though each tensor would fill a bucket of `bucket_mb` (no copy to bound; one checksum pass, one engine round
    trip); one adapter keeps `bucket_mb`'s buckets, and so do tensors elsewhere."""
    flat, buf = lend_buffer(4 * 64 * 1024, torch.float32, torch.device("cpu"))
    tensors = {f"t{i}": flat[i * 65536 : (i + 1) * 65536] for i in range(4)}
    emitter = emitter_for(ReadingEngine(delay_s=0))
    assert emitter.bucket_bytes < 2 * TENSOR_BYTES
    (bucket,) = emitter._plan_for(tensors, buf, whole=True)
    assert bucket.home == (buf, 0) and bucket.size == 4 * TENSOR_BYTES
    assert [b.home for b in emitter._plan_for(tensors, buf)] == [(buf, k * TENSOR_BYTES) for k in range(4)]
    elsewhere = {n: t.clone() for n, t in tensors.items()}
    assert len(emitter._plan_for(elsewhere, buf, whole=True)) == 4


def test_a_bucket_of_exactly_the_bytes_the_gather_checksummed_goes_with_that_checksum(emitter_for: Make) -> None:
    from titan_lora.transfer.buckets import bucket_checksum

    flat, buf = lend_buffer(4 * 64 * 1024, torch.float32, torch.device("cpu"))
    flat.copy_(torch.randn(flat.numel(), generator=torch.Generator().manual_seed(2)))
    tensors = {f"t{i}": flat[i * 65536 : (i + 1) * 65536] for i in range(4)}
    size = 4 * TENSOR_BYTES
    whole = bucket_checksum(buf.tensor[:size])
    engine = ReadingEngine(delay_s=0)
    emitter = emitter_for(engine, bucket_bytes=size)  # one bucket of every tensor
    ack = emitter.send_adapter(AdapterPayload("policy-v1", 1, tensors, {}, home=buf, home_checksum=(0, size, whole)))
    assert [b["checksum"] for b in engine.bodies] == [whole] and ack.phases_ms["checksum_ms"] == 0
    # A checksum of other bytes than the bucket's is not used: the bucket gets a pass of its own.
    engine.bodies.clear()
    emitter.send_adapter(AdapterPayload("policy-v2", 2, tensors, {}, home=buf,
                                        home_checksum=(0, TENSOR_BYTES, "w64:unused")))
    assert [b["checksum"] for b in engine.bodies] == [whole]
    # A wrong checksum of exactly the bucket's bytes is sent as it is, and the engine's copy refutes it.
    wrong = f"w64:{0:032x}:{size}"
    with pytest.raises(TransferError, match="checksum mismatch"):
        emitter.send_adapter(AdapterPayload("policy-v3", 3, tensors, {}, home=buf, home_checksum=(0, size, wrong)))


def test_a_read_only_mapping_sent_again_reuses_its_plan_and_a_plain_dict_is_looked_at_again(
        emitter_for: Make) -> None:
    import types

    flat, buf = lend_buffer(4 * 64 * 1024, torch.float32, torch.device("cpu"))
    tensors = {f"t{i}": flat[i * 65536 : (i + 1) * 65536] for i in range(4)}
    proxy = types.MappingProxyType(dict(tensors))  # what AdapterSource hands out every snapshot
    emitter = emitter_for(ReadingEngine())
    emitter.send_adapter(AdapterPayload("policy-v1", 1, proxy, {}, home=buf))
    plan = emitter._plan
    emitter._plan_key = ("stale",)  # the key is not even computed for the same read-only mapping
    emitter.send_adapter(AdapterPayload("policy-v2", 2, proxy, {}, home=buf))
    assert emitter._plan is plan
    tensors["t3"] = torch.zeros(8)  # a plain dict changed in place gets a new plan
    engine = ReadingEngine()
    emitter.client = engine
    emitter.send_adapter(AdapterPayload("policy-v3", 3, tensors, {}, home=buf))
    assert emitter._plan is not plan and torch.equal(engine.adapters["policy-v3"]["t3"], torch.zeros(8))


# ---- the engine's info and unload routes, request bodies, phase times, buffers ----------------------


class RouteEngine(ReadingEngine):
    """A ReadingEngine that also answers /titan/info and /titan/unload and records every request."""

    def __init__(self, info: dict | None = None, unloaded: object = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.info = info or {}
        self.unloaded = unloaded
        self.requests: list[tuple[str, dict | None, float | None]] = []
        self.threads: list[str] = []

    def post(self, route: str, body: dict | None = None, timeout_s: float | None = None) -> dict:
        import threading

        self.requests.append((route, body, timeout_s))
        self.threads.append(threading.current_thread().name)
        if route == "/titan/info":
            assert body is None
            return self.info
        if route == "/titan/unload":
            return {"unloaded": self.unloaded}
        return super().post(route, body, timeout_s)


def _small_payload(n: int = 2) -> AdapterPayload:
    tensors = {f"base_model.model.layers.{i}.q_proj.lora_A.weight": torch.full((8, 8), float(i + 1))
               for i in range(n)}  # 256 bytes each
    return AdapterPayload("policy-v9", 9, tensors, {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]})


def test_the_engines_limits_come_from_its_info() -> None:
    engine = RouteEngine({"max_lora_rank": 16, "max_loras": 4, "target_modules": ["v_proj", "q_proj"]})
    emitter = VLLMBucketEmitter(engine, bucket_mb=1)
    try:
        assert emitter.engine_limits() == EngineLimits(16, 4, frozenset({"q_proj", "v_proj"}))
        engine.info = {"max_lora_rank": 8, "max_loras": 2, "target_modules": None}
        assert emitter.engine_limits() == EngineLimits(8, 2, None)
        assert [r for r, _, _ in engine.requests] == ["/titan/info", "/titan/info"]
    finally:
        emitter.close()


def test_the_incarnation_says_when_the_engine_holds_no_base() -> None:
    engine = RouteEngine({"incarnation": "boot-7f", "base_version": 3})
    emitter = VLLMBucketEmitter(engine, bucket_mb=1)
    try:
        assert emitter.engine_incarnation() == "boot-7f"
        engine.info = {"incarnation": "boot-7f", "base_version": 0}
        assert emitter.engine_incarnation() == "boot-7f"
        engine.info = {"incarnation": "boot-7f", "base_version": None}
        assert emitter.engine_incarnation() == "boot-7f:no-base"
    finally:
        emitter.close()


@pytest.mark.parametrize("answer, want", [(True, True), (False, False), (1, True), (0, False)])
def test_retire_asks_the_engine_to_unload_within_the_timeout(answer: object, want: bool) -> None:
    engine = RouteEngine(unloaded=answer)
    emitter = VLLMBucketEmitter(engine, bucket_mb=1)
    try:
        assert emitter.retire_adapter("policy-v2", 7.5) is want
        assert engine.requests == [("/titan/unload", {"name": "policy-v2", "timeout_s": 7.5}, 17.5)]
    finally:
        emitter.close()


def test_buckets_are_megabytes() -> None:
    emitter = VLLMBucketEmitter(RouteEngine(), bucket_mb=3)
    try:
        assert emitter.bucket_bytes == 3 * 1024 * 1024
    finally:
        emitter.close()


def test_bucket_requests_name_the_transfer_its_kind_and_the_commit(emitter_for: Make) -> None:
    engine = RouteEngine(delay_s=0)
    emitter = emitter_for(engine, bucket_bytes=256)
    payload = _small_payload()
    emitter.send_adapter(payload)
    emitter.send_base(iter(payload.tensors.items()), version=9)
    adapter, base = engine.bodies[:2], engine.bodies[2:]
    assert [b["kind"] for b in engine.bodies] == ["adapter", "adapter", "base", "base"]
    ids = {b["transfer_id"] for b in adapter}, {b["transfer_id"] for b in base}
    assert all(len(i) == 1 for i in ids) and ids[0] != ids[1]
    assert all(isinstance(i, str) and len(i) == 32 for (i,) in ids)
    assert adapter[-1]["commit"] == {"name": "policy-v9", "version": 9,
                                     "peft_config": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}}
    assert engine.requests[-1] == ("/titan/base", {"transfer_id": base[0]["transfer_id"], "version": 9}, None)
    assert all(t.startswith("titan-bucket") for t, (r, _, _) in zip(engine.threads, engine.requests)
               if r == "/titan/bucket"), "buckets are posted from the emitter's own thread"


def test_a_layout_goes_with_its_header_once_and_again_after_the_engine_forgot_it(emitter_for: Make) -> None:
    from titan_lora.transfer.buckets import LayoutCache

    engine = RouteEngine(delay_s=0)
    emitter = emitter_for(engine, bucket_bytes=1024)
    payload = _small_payload()
    emitter.send_adapter(payload)
    emitter.send_adapter(dataclasses.replace(payload, name="policy-v10", version=10))
    assert ["header" in b for b in engine.bodies] == [True, False], "a known layout travels as its id"
    engine.layouts = LayoutCache()  # the engine restarted
    engine.bodies.clear()
    emitter.send_adapter(dataclasses.replace(payload, name="policy-v11", version=11))
    first, retry = engine.bodies
    assert "header" not in first and retry == {**first, "header": [e.to_json() for e in _entries(payload)]}
    assert [r for r, _, _ in engine.requests[-2:]] == ["/titan/bucket", "/titan/bucket"]
    assert "policy-v11" in engine.adapters


def _entries(payload: AdapterPayload) -> list:
    from titan_lora.transfer.buckets import plan_buckets

    (entries,) = plan_buckets(payload.tensors, 1024)
    return entries


def test_phase_times_are_milliseconds_of_the_clock(emitter_for: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    import itertools

    from titan_lora.clients import vllm

    engine = RouteEngine(delay_s=0)
    emitter = emitter_for(engine, bucket_bytes=256)  # two buckets
    clock = itertools.count(100)  # every reading advances one second
    monkeypatch.setattr(vllm.time, "perf_counter", lambda: float(next(clock)))
    ack = emitter.send_adapter(_small_payload())
    # started 100; bucket 1 packed 101..102, checksummed 103..104; bucket 2 packed 105..106, checksummed
    # 107..108; done at 109; the engine's own apply time (1 ms) is moved out of the transfer.
    assert ack.phases_ms == {"pack_ms": 2e3, "checksum_ms": 2e3, "transfer_ms": 5e3 - 1.0, "buckets": 2,
                             "apply_ms": 1.0}
    clock = itertools.count(100)
    emitter = emitter_for(engine, bucket_bytes=1024)
    ack = emitter.send_base(iter(_small_payload(2).tensors.items()), version=1)
    # started 100; two tensors packed 101..102 and 103..104 into one bucket; checksummed 105..106; done at
    # 107; the base applied 108..109
    assert ack.phases_ms == {"pack_ms": 2e3, "checksum_ms": 1e3, "transfer_ms": 4e3, "buckets": 1,
                             "apply_ms": 1e3}


def test_a_commit_that_is_not_acknowledged_fails_the_adapter(emitter_for: Make) -> None:
    class NoCommit(RouteEngine):
        def _bucket(self, body: dict) -> dict:
            ack = super()._bucket(body)
            ack.pop("commit", None)
            return ack

    with pytest.raises(TransferError) as err:
        emitter_for(NoCommit(delay_s=0)).send_adapter(_small_payload())
    assert str(err.value) == "the engine did not acknowledge the commit of adapter policy-v9"


@pytest.mark.parametrize("kind", ["adapter", "base"])
def test_a_wrong_count_names_what_was_sent(emitter_for: Make, kind: str) -> None:
    emitter = emitter_for(RouteEngine(delay_s=0, count_error=1), bucket_bytes=1024)
    with pytest.raises(TransferError) as err:
        if kind == "adapter":
            emitter.send_adapter(_small_payload())
        else:
            emitter.send_base(iter(_small_payload().tensors.items()), version=1)
    what = "adapter policy-v9" if kind == "adapter" else "base weights"
    assert str(err.value) == f"the engine acknowledged 3 tensors / 512 bytes of the {what}, but 2 / 512 were sent"


def test_a_checksum_mismatch_names_the_bucket_the_transfer_and_both_sums(emitter_for: Make) -> None:
    engine = RouteEngine(delay_s=0, checksums=False)
    with pytest.raises(TransferError) as err:
        emitter_for(engine).send_adapter(_small_payload())
    body = engine.bodies[0]
    assert str(err.value) == (f"checksum mismatch in bucket 0 of the adapter transfer {body['transfer_id']}: sent "
                              f"{body['checksum']}, the engine copied out None (None: the engine does not "
                              "checksum; run the same titan_lora on both sides)")


def test_two_packing_buffers_are_kept_while_tensors_fit_and_replaced_when_not(emitter_for: Make) -> None:
    engine = RouteEngine(delay_s=0)
    emitter = emitter_for(engine, bucket_bytes=256)
    one = {"w": torch.ones(64)}  # exactly one bucket (256 bytes)
    emitter.send_base(iter(one.items()), version=1)
    first = list(emitter._buffers)
    assert len(first) == 2 and all(b.size == 256 for b in first)
    emitter.send_base(iter(one.items()), version=2)
    emitter.send_adapter(AdapterPayload("policy-v3", 3, {"a.lora_A.weight": torch.ones(64)}, {}))
    assert all(a is b for a, b in zip(emitter._buffers, first)), "buffers that fit were replaced"
    emitter.send_base(iter({"big": torch.ones(100)}.items()), version=4)  # 400 bytes: larger buffers
    assert len(emitter._buffers) == 2 and all(b.size == 400 for b in emitter._buffers)


def test_tensors_that_fill_a_bucket_exactly_share_it(emitter_for: Make) -> None:
    engine = RouteEngine(delay_s=0)
    emitter = emitter_for(engine, bucket_bytes=512)
    ack = emitter.send_base(iter({"a": torch.ones(64), "b": torch.ones(64), "c": torch.ones(1)}.items()), version=1)
    assert ack.phases_ms["buckets"] == 2 and [len(b["header"]) for b in engine.bodies] == [2, 1]


def test_packing_buffers_that_cannot_be_made_are_an_emitter_error(emitter_for: Make,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from titan_lora.clients import vllm

    def no_shm(n: int, size: int, device: torch.device, transport: object = None) -> list:
        raise OSError("cannot reserve 1 MiB of shared memory")

    monkeypatch.setattr(vllm, "make_buffers", no_shm)
    emitter = emitter_for(RouteEngine(delay_s=0))
    with pytest.raises(TransferError) as err:
        emitter.send_adapter(_small_payload())
    assert str(err.value) == "cannot reserve 1 MiB of shared memory" and emitter._buffers == []


def test_close_collects_cuda_ipc_blocks_only_for_cuda_buffers_and_may_repeat(monkeypatch: pytest.MonkeyPatch) -> None:
    collected: list[int] = []
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: collected.append(1))

    class Buf:
        def __init__(self, device: str) -> None:
            self.device, self.closed = torch.device(device), False

        def close(self) -> None:
            self.closed = True

    emitter = VLLMBucketEmitter(RouteEngine(), bucket_mb=1)
    bufs = [Buf("cpu"), Buf("cpu")]
    emitter._buffers = bufs
    emitter.close()
    assert collected == [] and all(b.closed for b in bufs) and emitter._buffers == []
    emitter.close()
    emitter = VLLMBucketEmitter(RouteEngine(), bucket_mb=1)
    emitter._buffers = [Buf("cuda")]
    emitter.close()
    assert collected == [1]


ZERO_SUM = f"w64:{0:032x}:512"


def test_a_wrong_checksum_is_quoted_in_the_error(emitter_for: Make) -> None:
    class WrongSum(RouteEngine):
        def _bucket(self, body: dict) -> dict:
            return {**super()._bucket(body), "checksum": ZERO_SUM}

    engine = WrongSum(delay_s=0)
    with pytest.raises(TransferError) as err:
        emitter_for(engine, bucket_bytes=1024).send_adapter(_small_payload())
    assert str(err.value).endswith(f"sent {engine.bodies[0]['checksum']}, the engine copied out "
                                   f"{ZERO_SUM} (None: the engine does not checksum; run the same "
                                   "titan_lora on both sides)")


def test_two_transfers_on_one_emitter_run_one_after_the_other(emitter_for: Make) -> None:
    # A replica's revival can send the base while a fan-out call still runs on the same emitter: sharing
    # its two packing buffers, each would overwrite the other's buckets before the engine copied them.
    import threading

    engine = ReadingEngine(delay_s=0.01)
    emitter = emitter_for(engine)
    first = _payload()
    second = dataclasses.replace(first, name="policy-v4", version=4,
                                 tensors={k: t + 100.0 for k, t in first.tensors.items()})
    errors: list[BaseException] = []

    def send(payload: AdapterPayload) -> None:
        try:
            emitter.send_adapter(payload)
        except BaseException as err:  # noqa: BLE001 (reported below)
            errors.append(err)

    threads = [threading.Thread(target=send, args=(p,)) for p in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    ids = [b["transfer_id"] for b in engine.bodies]
    assert ids == sorted(ids, key=ids.index) and len(set(ids)) == 2
    assert ids.index(ids[-1]) == 4, "the second transfer's buckets came only after the first's four"
    for payload in (first, second):
        got = engine.adapters[payload.name]
        for name, sent in payload.tensors.items():
            assert torch.equal(got[name], sent), f"{payload.name}: {name} arrived with the other's bytes"


def test_a_slow_engine_shows_in_the_transfer_phase_not_in_packing(emitter_for: Make) -> None:
    # Packing waits for a slot the engine still copies from; that wait (and the posts' checksums) used to
    # count as packing, and the base's transfer phase came out negative (-34 ms on the 8B base, H100).
    engine = ReadingEngine(delay_s=0.05)
    emitter = emitter_for(engine)
    ack = emitter.send_base(iter(_payload().tensors.items()), version=1)
    phases = ack.phases_ms
    assert phases["buckets"] == 4 and phases["transfer_ms"] >= 4 * 50 * 0.9, phases
    assert phases["pack_ms"] < phases["transfer_ms"] / 4, phases
