"""Shared buffers: a tensor from `shared_tensor` is found again from any view; an engine-side mapping of
its descriptor (with the bucket's byte offset) sees the same bytes; each buffer gets its own mapping,
only bare segment names are mapped, and mappings of removed segments are released."""

from __future__ import annotations

import os

import pytest
import torch

from titan_lora.transfer import transport
from titan_lora.transfer.transport import BucketBuffer, BufferCache, home_of, make_buffers, shared_tensor


def test_a_view_of_a_shared_tensor_is_sent_in_place_from_its_offset() -> None:
    full = shared_tensor(1000, torch.float32, torch.device("cpu"))
    assert torch.count_nonzero(full) == 0, "shared tensors start zeroed"
    view = full[100:164]
    view.copy_(torch.arange(64, dtype=torch.float32))
    buf, offset = home_of(view)
    assert offset == 400, "offset in bytes from the buffer's start"

    engine_side = BufferCache()  # holds the mapping open, as the engine does
    mapped = engine_side.get(buf.describe(offset))  # a separate mapping of the same memory
    assert mapped.data_ptr() != view.data_ptr()
    assert torch.equal(mapped[: 64 * 4].view(torch.float32), view)
    view.mul_(2)  # the trainer writes the next version into the same buffer
    assert torch.equal(mapped[: 64 * 4].view(torch.float32), view)


def test_plain_tensors_have_no_home() -> None:
    assert home_of(torch.zeros(8)) is None


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

    def fake_open(desc: dict) -> torch.Tensor:  # the storage's first byte says which buffer it is
        opened.append(desc["storage_offset"])
        return torch.full((1024,), desc["storage_offset"] // 1024, dtype=torch.uint8)

    monkeypatch.setattr(transport, "_open", fake_open)
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
    real_open = transport._open
    monkeypatch.setattr(transport, "_open", lambda desc: opens.append(desc["name"]) or real_open(desc))
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


def test_a_link_in_shm_is_not_followed(tmp_path) -> None:  # noqa: ANN001
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
