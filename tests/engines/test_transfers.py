"""The engine side's `receive`: a bucket request parsed once (`BucketRequest.parse`) lands in a pooled
slab once, straight from the wire for a fetching transport (tcp), by one copy out of the mapping for a
mapped one (shm), with the trainer's bytes either way."""

from __future__ import annotations

import pytest
import torch

import titan_lora.engines.transfers as transfers
from titan_lora.transfer.buckets import bucket_checksum, bucket_size, pack, plan_buckets
from titan_lora.transfer.transport import BufferCache, TransportChoice
from titan_lora.transfer.transports import base, tcp

CPU = torch.device("cpu")


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_a_bucket_is_received_into_a_pooled_slab_with_one_copy_at_most(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(41 * (i + 1), generator=g) for i in range(6)}
    entries = plan_buckets(tensors, 1 << 20)[0]
    buf = TransportChoice(kind).buffer(1 << 20, CPU)
    copies = []
    copy_flat = base.copy_flat
    monkeypatch.setattr(base, "copy_flat", lambda dst, src: copies.append(1) or copy_flat(dst, src))
    try:
        pool, store = transfers.SlabPool(), transfers.TransferStore()
        for version in range(3):  # the second and third reuse the first's slab
            tensors = {n: t + version for n, t in tensors.items()}
            pack(buf.tensor[512:], entries, tensors)
            sent = bucket_checksum(buf.tensor[512 : 512 + bucket_size(entries)])
            req = transfers.BucketRequest.parse({"transfer_id": f"v{version}", "layout": "L",
                                                 "segment": buf.describe(512), "checksum": sent})
            assert transfers.receive(BufferCache(), pool, store, req, entries)["checksum"] == sent
            staged = store.take(f"v{version}")
            assert all(torch.equal(staged.tensors[n], t) for n, t in tensors.items()), version
            pool.give_all(staged)
        assert len(copies) == (0 if kind == "tcp" else 3), "tcp receives into the slab; shm copies out once"
    finally:
        buf.close()


def test_a_refused_fetch_stages_nothing_and_gives_its_slab_back() -> None:
    tensors = {"t": torch.arange(64, dtype=torch.float32)}
    entries = plan_buckets(tensors, 1 << 20)[0]
    buf = TransportChoice("tcp").buffer(1 << 16, CPU)
    try:
        pool, store = transfers.SlabPool(), transfers.TransferStore()
        wrong = {**buf.describe(0), "token": "00" * 16}
        req = transfers.BucketRequest.parse({"transfer_id": "v1", "kind": "adapter", "segment": wrong,
                                             "layout": "L", "checksum": "x"})
        with pytest.raises(tcp.TcpRefused, match="wrong token"):
            transfers.receive(BufferCache(), pool, store, req, entries)
        assert store.pending() == {}, "a refused bucket left a staged transfer behind"
        assert len(pool._free[("L", CPU)]) == 1, "the slab taken for the fetch was not given back"
    finally:
        buf.close()


def test_only_an_adapters_buckets_take_the_graphed_copy_and_checksum(monkeypatch: pytest.MonkeyPatch) -> None:
    """A base bucket comes once per base send, each in a slab of its own: a CUDA graph captured for it (a
    device sync and an allocator cache flush each) is never replayed. An adapter's slabs recur."""
    asked: list[tuple[str, str, bool]] = []
    copy, checksum = base.copy_with_checksum, transfers.bucket_checksum

    def recorded_copy(dst: torch.Tensor, src: torch.Tensor, *, graphed: bool) -> str | None:
        asked.append((kind, "copy", graphed))
        return copy(dst, src, graphed=graphed)

    def recorded_checksum(data: torch.Tensor, *, graphed: bool) -> str:
        asked.append((kind, "checksum", graphed))
        return checksum(data, graphed=graphed)

    monkeypatch.setattr(base, "copy_with_checksum", recorded_copy)
    monkeypatch.setattr(transfers, "bucket_checksum", recorded_checksum)
    tensors = {f"t{i}": torch.randn(1000) for i in range(6)}
    planned = plan_buckets(tensors, 8192)  # a bucket per tensor or two
    buf = TransportChoice("shm").buffer(1 << 16, CPU)
    try:
        pool, store = transfers.SlabPool(), transfers.TransferStore()
        for kind in ("base", "adapter", "adapter"):
            for i, entries in enumerate(planned):
                pack(buf.tensor, entries, tensors)
                sent = bucket_checksum(buf.tensor[: bucket_size(entries)])
                req = transfers.BucketRequest.parse({"transfer_id": kind + str(len(asked)), "kind": kind,
                                                     "segment": buf.describe(0), "layout": f"L{i}",
                                                     "checksum": sent})
                assert transfers.receive(BufferCache(), pool, store, req, entries)["checksum"] == sent
    finally:
        buf.close()
    assert len(planned) >= 3 and len(asked) == 3 * 2 * len(planned), asked
    assert all(graphed == (kind == "adapter") for kind, _, graphed in asked), asked


def test_a_bucket_looks_its_transport_up_once_where_its_request_is_parsed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The route parses the descriptor (its transport found by kind) once; receiving it asks no registry."""
    looked_up: list[object] = []
    named = base.transport_named
    monkeypatch.setattr(base, "transport_named", lambda kind: looked_up.append(kind) or named(kind))
    tensors = {"t": torch.arange(64, dtype=torch.float32)}
    entries = plan_buckets(tensors, 1 << 20)[0]
    for kind in ("shm", "tcp"):
        buf = TransportChoice(kind).buffer(1 << 16, CPU)
        try:
            pack(buf.tensor, entries, tensors)
            sent = bucket_checksum(buf.tensor[: bucket_size(entries)])
            req = transfers.BucketRequest.parse({"transfer_id": kind, "segment": buf.describe(0),
                                                 "layout": "L", "checksum": sent})
            transfers.receive(BufferCache(), transfers.SlabPool(), transfers.TransferStore(), req, entries)
        finally:
            buf.close()
    assert looked_up == ["shm", "tcp"], looked_up


@pytest.mark.parametrize(("field", "value", "error"), [
    ("kind", "weights", "bucket kind must be one of ['adapter', 'base'], got 'weights'"),
    ("segment", "psm_x", "a bucket's segment must be a JSON object, got str"),
])
def test_a_malformed_request_is_refused_when_parsed(field: str, value: object, error: str) -> None:
    body = {"transfer_id": "v1", "layout": "L", "segment": {"kind": "shm", "name": "x", "size": 8},
            field: value}
    with pytest.raises(ValueError) as err:
        transfers.BucketRequest.parse(body)
    assert str(err.value) == error


def test_a_negative_offset_is_refused_before_any_byte_is_read() -> None:
    """A negative offset would index a mapping from its end: the engine would ack the buffer's tail."""
    tensors = {"t": torch.arange(16, dtype=torch.float32)}
    entries = plan_buckets(tensors, 1 << 20)[0]
    buf = TransportChoice("shm").buffer(4096, CPU)
    try:
        pack(buf.tensor[4096 - 64 :], entries, tensors)  # the tail holds a whole, well-formed bucket
        tail = bucket_checksum(buf.tensor[4096 - 64 :])
        body = {"transfer_id": "v1", "segment": {**buf.describe(0), "offset": -64}, "layout": "L",
                "checksum": tail}
        store = transfers.TransferStore()
        with pytest.raises(ValueError) as err:
            transfers.receive(BufferCache(), transfers.SlabPool(), store, transfers.BucketRequest.parse(body),
                              entries)
        assert str(err.value) == "a bucket's segment offset must be a byte count of 0 or more, got -64"
        assert store.pending() == {}
    finally:
        buf.close()
