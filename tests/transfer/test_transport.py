"""Shared buffers: a lent tensor's views are located in their buffer; an engine-side mapping of its
descriptor (with the bucket's byte offset) sees the same bytes; each buffer gets its own mapping, only
bare segment names are mapped, and mappings of removed segments are released."""

from __future__ import annotations

import os

import pytest
import torch

from titan_lora.transfer import transport
from titan_lora.transfer.transports import base, cuda_ipc, shm
from titan_lora.transfer.transport import BucketBuffer, BufferCache, lend_buffer, make_buffers, offset_in
from titan_lora.transfer.transports.base import BucketDesc


def test_a_view_of_a_lent_tensor_is_sent_in_place_from_its_offset() -> None:
    full, buf = lend_buffer(1000, torch.float32, torch.device("cpu"))
    assert torch.count_nonzero(full) == 0, "lent tensors start zeroed"
    view = full[100:164]
    view.copy_(torch.arange(64, dtype=torch.float32))
    offset = offset_in(buf, view)
    assert offset == 400, "offset in bytes from the buffer's start"

    engine_side = BufferCache()  # holds the mapping open, as the engine does
    mapped = engine_side.get(buf.describe(offset))  # a separate mapping of the same memory
    assert mapped.data_ptr() != view.data_ptr()
    assert torch.equal(mapped[: 64 * 4].view(torch.float32), view)
    view.mul_(2)  # the trainer writes the next version into the same buffer
    assert torch.equal(mapped[: 64 * 4].view(torch.float32), view)


def test_a_tensor_elsewhere_has_no_offset_in_the_buffer() -> None:
    _, buf = lend_buffer(8, torch.float32, torch.device("cpu"))
    other, _ = lend_buffer(8, torch.float32, torch.device("cpu"))
    assert offset_in(buf, torch.zeros(8)) is None and offset_in(buf, other[2:]) is None


def test_an_engine_that_cannot_see_the_segment_refuses_instead_of_reading_zeros() -> None:
    desc = {"kind": "shm", "name": "psm_titan_lora_no_such_segment", "size": 4096, "offset": 0}
    with pytest.raises(FileNotFoundError, match="not visible here"):
        BufferCache().get(desc)


def _fake_ipc(storage_offset: int, offset: int = 0) -> dict:
    """A CUDA IPC descriptor as `BucketBuffer.describe` writes it (the handle names the segment)."""
    return {"kind": "cuda_ipc", "size": [1024], "stride": [1], "tensor_offset": 0, "device": 0,
            "handle": "c2VnbWVudA==", "storage_bytes": 1024, "storage_offset": storage_offset,
            "ref_handle": "cmVm", "ref_offset": 0, "event_handle": "", "event_sync": False, "offset": offset}


def test_two_buffers_of_one_cuda_segment_get_two_mappings(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[int] = []

    def fake_open(_: cuda_ipc.CudaIpcOpener, desc: dict) -> torch.Tensor:  # its first byte says which buffer
        opened.append(desc["storage_offset"])
        return torch.full((1024,), desc["storage_offset"] // 1024, dtype=torch.uint8)

    monkeypatch.setattr(cuda_ipc.CudaIpcOpener, "open", fake_open)
    cache = BufferCache()
    first, second = cache.get(_fake_ipc(0)), cache.get(_fake_ipc(1024))
    assert (int(first[0]), int(second[0])) == (0, 1), "the second buffer was served from the first's mapping"
    assert int(cache.get(_fake_ipc(1024, offset=1000))[0]) == 1 and len(cache.get(_fake_ipc(0, 1000))) == 24
    assert opened == [0, 1024], "each buffer is mapped once; the bucket offset is applied after the lookup"


def test_a_buffer_is_described_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = BucketBuffer._describe
    monkeypatch.setattr(BucketBuffer, "_describe", lambda self: calls.append(1) or real(self))
    buf = BucketBuffer(4096, torch.device("cpu"))
    try:
        descs = [buf.describe(offset) for offset in (0, 64, 0)]
        assert [d["offset"] for d in descs] == [0, 64, 0]
        assert len(calls) == 1, "every post re-shared the storage (on CUDA: a new IPC ref counter each time)"
    finally:
        buf.close()


def test_prune_releases_mappings_of_removed_segments_and_the_cache_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bufs = make_buffers(3, 4096, torch.device("cpu"))
    opens = []
    real_open = shm.ShmOpener.open
    monkeypatch.setattr(shm.ShmOpener, "open",
                        lambda self, desc: opens.append(desc["name"]) or real_open(self, desc))
    try:
        cache = BufferCache(max_entries=2)
        for buf in bufs:
            cache.get(buf.describe())
        assert len(cache) == 2, "the least recently used mapping is dropped beyond max_entries"
        cache.get(bufs[0].describe())
        assert opens == [b._shm.name for b in bufs] + [bufs[0]._shm.name], "the evicted one is mapped again"
        bufs[2].close()  # its trainer freed it (or died and the segment was removed)
        assert cache.prune() == 1 and len(cache) == 1
        assert cache.prune() == 0
    finally:
        for buf in bufs[:2]:
            buf.close()


@pytest.mark.parametrize("name", ["../etc/passwd", "a/b", "..", ".hidden", "x\0y", ""])
def test_only_bare_segment_names_are_mapped(name: str) -> None:
    with pytest.raises(ValueError, match="not a bare name"):
        BufferCache().get({"kind": "shm", "name": name, "size": 1, "offset": 0})


def test_a_link_in_shm_is_not_followed(tmp_path) -> None:
    target = tmp_path / "secret"
    target.write_bytes(b"x" * 4096)
    link = os.path.join(transport.SHM_DIR, f"titan_lora_test_link_{os.getpid()}")
    os.symlink(target, link)
    try:
        with pytest.raises(ValueError, match="not a regular file"):
            BufferCache().get({"kind": "shm", "name": os.path.basename(link), "size": 4096, "offset": 0})
    finally:
        os.unlink(link)


def _read_in_engine(_: int, descs: list[dict], want: list[int]) -> None:
    cache = BufferCache()
    for desc, byte in zip(descs, want):
        got = cache.get(desc)
        assert got.numel() == desc["size"][0] - desc["offset"], "the bucket offset was applied twice"
        seen = torch.unique(got).tolist()
        assert seen == [byte], f"buffer at storage offset {desc['storage_offset']} read {seen}, not [{byte}]"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_buffers_carved_from_one_segment_are_read_apart() -> None:
    device = torch.device("cuda", 0)
    big = torch.empty(2**30, dtype=torch.uint8, device=device)  # a realistic history: a freed 1 GiB segment
    del big
    bufs = make_buffers(2, 256 * 2**20, device)
    for buf, byte in zip(bufs, (0x11, 0x22)):
        buf.tensor.fill_(byte)
    torch.cuda.synchronize(device)
    descs = [bufs[0].describe(), bufs[1].describe(), bufs[1].describe(4096)]
    assert descs[0]["handle"] == descs[1]["handle"], "the allocator carved both from one segment"
    torch.multiprocessing.spawn(_read_in_engine, args=(descs, [0x11, 0x22, 0x22]), nprocs=1)
    for buf in bufs:
        buf.close()


# ---- CUDA descriptors without a GPU, shared-memory reservation, fallbacks ---------------------------

# What torch's reduce_tensor returns for a CUDA tensor: 15 fields, distinctive values for each.
_REDUCED = (torch.Tensor, (64,), (1,), 0, None, None, 1, b"segment-handle", 8192, 128, None, b"ref-counter",
            16, b"event", True)


class _TorchOnCuda:
    """cuda_ipc's view of torch with CUDA allocation and streams recorded instead of run."""

    def __init__(self) -> None:
        self.allocated: list[tuple] = []
        self.synced: list[torch.device] = []
        outer = self

        class _Stream:
            def __init__(self, device: torch.device) -> None:
                self.device = device

            def synchronize(self) -> None:
                outer.synced.append(self.device)

        self.cuda = type("cuda", (), {"current_stream": staticmethod(lambda device: _Stream(device))})

    def empty(self, size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.allocated.append((size, dtype, device))
        return torch.empty(size, dtype=dtype)

    def __getattr__(self, name: str):
        return getattr(torch, name)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> _TorchOnCuda:
    fake = _TorchOnCuda()
    monkeypatch.setattr(cuda_ipc, "torch", fake)
    monkeypatch.setattr(base, "torch", fake)  # BucketBuffer.synchronize waits on the CUDA stream
    fake.reduced = []
    monkeypatch.setattr(cuda_ipc.reductions, "reduce_tensor",
                        lambda t: fake.reduced.append(t) or ("rebuild", _REDUCED))
    return fake


def test_a_cuda_buffer_is_allocated_on_its_device_and_described_by_its_ipc_handle(fake_cuda) -> None:
    device = torch.device("cuda", 1)
    buf = BucketBuffer(64, device)
    assert fake_cuda.allocated == [(64, torch.uint8, device)] and not hasattr(buf, "_shm")
    assert buf.describe(32) == {
        "kind": "cuda_ipc", "size": [64], "stride": [1], "tensor_offset": 0, "device": 1,
        "handle": "c2VnbWVudC1oYW5kbGU=", "storage_bytes": 8192, "storage_offset": 128,
        "ref_handle": "cmVmLWNvdW50ZXI=", "ref_offset": 16, "event_handle": "ZXZlbnQ=", "event_sync": True,
        "offset": 32}
    assert len(fake_cuda.reduced) == 1 and fake_cuda.reduced[0] is buf.tensor, "the buffer itself is shared"
    buf.synchronize()
    assert fake_cuda.synced == [device]
    buf.close()
    assert not hasattr(buf, "tensor")


def test_a_cpu_buffer_needs_no_stream_synchronisation(fake_cuda) -> None:
    buf = BucketBuffer(64, torch.device("cpu"))
    try:
        buf.synchronize()
        assert fake_cuda.synced == [] and fake_cuda.allocated == []
    finally:
        buf.close()


def test_a_cuda_descriptor_rebuilds_the_same_ipc_tensor(fake_cuda, monkeypatch: pytest.MonkeyPatch) -> None:
    rebuilt: list[tuple] = []
    monkeypatch.setattr(cuda_ipc.reductions, "rebuild_cuda_tensor",
                        lambda *args: rebuilt.append(args) or torch.arange(64, dtype=torch.uint8))
    desc = BucketBuffer(64, torch.device("cuda", 1)).describe(8)
    got = BufferCache().get(desc)
    assert torch.equal(got, torch.arange(8, 64, dtype=torch.uint8)), "the bucket offset applies to the mapping"
    assert rebuilt == [(torch.Tensor, (64,), (1,), 0, torch.storage.UntypedStorage, torch.uint8, 1,
                        b"segment-handle", 8192, 128, False, b"ref-counter", 16, b"event", True)]
    rebuilt.clear()
    cuda_ipc.CudaIpcOpener().open({**desc, "event_handle": ""})
    assert rebuilt[0][13] == b"", "no event: an empty handle"


def test_an_unknown_device_or_transport_is_refused() -> None:
    with pytest.raises(ValueError) as err:
        BucketBuffer(64, torch.device("meta"))
    assert str(err.value) == "no bucket transport for device type 'meta'"
    with pytest.raises(ValueError) as err:
        BucketDesc.parse({"kind": "rdma"})
    assert str(err.value) == ("unknown bucket transport 'rdma': this process has cuda_ipc, nccl, shm, tcp (a plug-in "
                              "transport must be registered with register_transport in the trainer and in the "
                              "engine process)")


def test_a_shm_buffer_reserves_exactly_its_size_and_is_the_file_in_dev_shm() -> None:
    buf = BucketBuffer(4096, torch.device("cpu"))
    try:
        path = os.path.join(transport.SHM_DIR, buf._shm.name)
        assert os.stat(path).st_size == 4096
        buf.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        with open(path, "rb") as f:
            assert f.read(4) == b"\x01\x02\x03\x04", "the tensor maps the segment in /dev/shm itself"
    finally:
        buf.close()
    assert not os.path.exists(path)


def test_shared_memory_that_cannot_be_reserved_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[str] = []
    real = shm.shared_memory.SharedMemory

    def record(*args, **kwargs):
        shm = real(*args, **kwargs)
        made.append(shm.name)
        return shm

    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shm.shared_memory, "SharedMemory", record)
    monkeypatch.setattr(shm.os, "posix_fallocate", full)
    with pytest.raises(OSError) as err:
        BucketBuffer(3 * 2**20, torch.device("cpu"))
    assert str(err.value) == ("cannot reserve 3 MiB of shared memory in /dev/shm ([Errno 28] No space left on "
                              "device): enlarge it (docker: --shm-size) or lower [weight_sync] bucket_mb")
    assert isinstance(err.value.__cause__, OSError)
    assert made and not os.path.exists(os.path.join(transport.SHM_DIR, made[0])), "the segment was removed"


def test_lent_tensors_are_sized_by_their_dtype() -> None:
    t, buf = lend_buffer(6, torch.bfloat16, torch.device("cpu"))
    assert (t.dtype, t.shape, offset_in(buf, t), buf.size) == (torch.bfloat16, (6,), 0, 12)


def test_without_shared_memory_a_lent_tensor_is_a_plain_zeroed_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_shm(size: int, device: torch.device) -> None:
        raise OSError("no /dev/shm")

    monkeypatch.setattr(transport, "BucketBuffer", no_shm)
    t, buf = lend_buffer(5, torch.bfloat16, torch.device("cpu"))
    assert (t.shape, t.dtype, t.device) == ((5,), torch.bfloat16, torch.device("cpu"))
    assert torch.count_nonzero(t) == 0 and buf is None


def test_a_missing_segment_says_where_the_engine_must_run() -> None:
    desc = {"kind": "shm", "name": "psm_titan_lora_absent", "size": 4096, "offset": 0}
    with pytest.raises(FileNotFoundError) as err:
        BufferCache().get(desc)
    assert str(err.value) == ("shared memory /dev/shm/psm_titan_lora_absent (4096 bytes) is not visible here: "
                              "the engine must run on the trainer's host and see its /dev/shm (same container "
                              "or --ipc=host)")


def test_a_cuda_buffer_without_an_event_has_an_empty_event_handle(fake_cuda, monkeypatch: pytest.MonkeyPatch) -> None:
    no_event = (*_REDUCED[:13], b"", False)
    monkeypatch.setattr(cuda_ipc.reductions, "reduce_tensor", lambda t: ("rebuild", no_event))
    desc = BucketBuffer(64, torch.device("cuda", 0)).describe()
    assert (desc["event_handle"], desc["event_sync"]) == ("", False)


def test_without_a_transport_a_lent_tensor_stays_on_its_device() -> None:
    t, buf = lend_buffer(3, torch.float16, torch.device("meta"))  # no bucket transport on "meta": a plain tensor
    assert (t.device.type, t.dtype, t.shape) == ("meta", torch.float16, (3,)) and buf is None


def test_one_buffer_is_one_mapping_whatever_the_key_order_and_offset() -> None:
    buf = BucketBuffer(4096, torch.device("cpu"))
    try:
        cache = BufferCache()
        desc = buf.describe(128)
        reordered = dict(reversed(list(desc.items())))
        first, second = cache.get(desc), cache.get(reordered)
        assert len(cache) == 1 and first.numel() == second.numel() == 4096 - 128
        bare = {k: v for k, v in desc.items() if k != "offset"}
        assert cache.get(bare).numel() == 4096, "no offset: the bucket starts at the buffer's start"
    finally:
        buf.close()


def test_the_cache_holds_32_mappings_by_default() -> None:
    assert BufferCache().max_entries == 32


def test_prune_keeps_the_mappings_of_segments_that_still_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    bufs = make_buffers(2, 4096, torch.device("cpu"))
    opens: list[str] = []
    real_open = shm.ShmOpener.open
    monkeypatch.setattr(shm.ShmOpener, "open",
                        lambda self, desc: opens.append(desc["name"]) or real_open(self, desc))
    try:
        cache = BufferCache()
        for buf in bufs:
            cache.get(buf.describe())
        bufs[1].close()
        assert cache.prune() == 1
        cache.get(bufs[0].describe())
        assert opens == [bufs[0]._shm.name, bufs[1]._shm.name], "the live segment's mapping was dropped"
    finally:
        bufs[0].close()


def test_a_fetched_buffer_is_refused_as_a_mapping() -> None:
    desc = {"kind": "tcp", "host": "127.0.0.1", "port": 1, "id": "00" * 16, "token": "00" * 16, "size": 8}
    with pytest.raises(ValueError) as err:
        BufferCache().get(desc)
    assert str(err.value) == "tcp buffers cannot be mapped, only fetched per bucket"
