"""The nccl transport in isolation, over its gloo fallback (the same code as NCCL on GPUs): a bucket
received over the trainer's group through `BucketDesc.receive_into` has the trainer's bytes and checksum, the
engine joins one group per incarnation and receives every bucket anew, refusals come back as words, and
every wait is bounded: a receive that never comes, a worker that dies after asking."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from dist_helpers import free_port
from wait_helpers import waited

from titan_lora.transfer.buckets import bucket_checksum, bucket_size, copy_out, pack, plan_buckets
from titan_lora.transfer.placement import choose_transport
from titan_lora.transfer.transport import BufferCache, TransportChoice
from titan_lora.transfer.transports.base import BucketDesc
from titan_lora.transfer.transports import nccl
from titan_lora.transfer.transports.tcp import TcpRefused

CPU = torch.device("cpu")


def _received(cache: BufferCache, desc: dict, nbytes: int) -> torch.Tensor:
    """The `nbytes` bytes of the bucket `desc` names, as the engine receives them into its slab."""
    into = torch.empty(nbytes, dtype=torch.uint8)
    BucketDesc.parse(desc).receive_into(into, cache)
    return into


@pytest.fixture
def buf():
    # A hub of its own (its own port): a port-0 hub is shared by every nccl buffer of this process, so
    # groups of other tests' engines could still be in it.
    b = nccl.NcclBuffer(1 << 20, CPU, backend="gloo", port=free_port())
    yield b
    b.close()


@pytest.fixture
def fetcher():
    f = nccl.NcclFetcher()
    yield f
    f.close()


def _desc(buf: nccl.NcclBuffer, offset: int = 0) -> dict:
    return json.loads(json.dumps(buf.describe(offset)))



def test_a_bucket_received_over_the_group_has_the_trainers_bytes_and_checksum(buf: nccl.NcclBuffer) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(37 * (i + 1), generator=g) for i in range(5)}
    entries = plan_buckets(tensors, 1 << 20)[0]
    offset = 4096  # a bucket in the middle of the buffer, as the gatherer's lent buffer holds them
    pack(buf.tensor[offset:], entries, tensors)
    sent = bucket_checksum(buf.tensor[offset : offset + bucket_size(entries)])
    desc = _desc(buf, offset)
    assert set(desc) == {"kind", "host", "port", "id", "token", "size", "backend", "offset"}
    assert (desc["kind"], desc["backend"]) == ("nccl", "gloo")
    cache = BufferCache()
    owned, views = copy_out(_received(cache, desc, bucket_size(entries)), entries)
    assert bucket_checksum(owned) == sent
    for name, t in tensors.items():
        assert torch.equal(views[name], t), name
    assert len(cache) == 0, "a received buffer is never cached"


def test_one_group_per_incarnation_and_every_bucket_received_anew(buf: nccl.NcclBuffer, fetcher) -> None:
    desc = _desc(buf)
    into = torch.empty(1000, dtype=torch.uint8)
    buf.tensor[:1000] = 7
    fetcher.fetch(desc, 0, into)
    assert int(into.sum()) == 7000
    (link,) = fetcher._links.values()
    buf.tensor[:1000] = 9  # the trainer reuses the buffer for the next bucket, same descriptor
    fetcher.fetch(desc, 0, into)
    assert int(into.sum()) == 9000 and list(fetcher._links.values()) == [link], "the group was joined once"
    (group,) = buf._server._groups.values()
    assert (group.world, group.members) == (2, {1})
    fetcher.close()  # the engine goes; a new incarnation joins a new group
    assert waited(lambda: not buf._server._groups), "the trainer dropped the ended incarnation's group"
    assert group.failed
    again = nccl.NcclFetcher()
    try:
        again.fetch(desc, 0, into)
        (regroup,) = buf._server._groups.values()
        assert regroup.name != group.name and int(into.sum()) == 9000
    finally:
        again.close()


def test_an_engine_of_two_workers_gets_every_bucket_on_each(buf: nccl.NcclBuffer) -> None:
    # A group of three (trainer + two workers) moves each bucket by send/recv; a group of two by broadcast.
    fetchers = [nccl.NcclFetcher() for _ in range(2)]
    for rank, f in enumerate(fetchers):
        f.join_as(rank, 2, "one engine of two workers")
    outs = [torch.zeros(300, dtype=torch.uint8) for _ in fetchers]
    try:
        for value in (5, 6):  # the second bucket goes over the same group
            buf.tensor[100:400] = torch.arange(300, dtype=torch.uint8) + value
            with ThreadPoolExecutor(2) as pool:
                list(pool.map(lambda i: fetchers[i].fetch(_desc(buf), 100, outs[i]), range(2)))
            assert all(torch.equal(out, buf.tensor[100:400]) for out in outs), value
        (group,) = buf._server._groups.values()
        assert (group.world, group.members) == (3, {1, 2})
    finally:
        for f in fetchers:
            f.close()


def test_refusals_come_back_as_words_and_the_group_stays(buf: nccl.NcclBuffer, fetcher) -> None:
    desc = _desc(buf)
    into = torch.empty(64, dtype=torch.uint8)
    with pytest.raises(TcpRefused, match="wrong token"):
        fetcher.fetch({**desc, "token": "00" * 16}, 0, into)  # no group is joined with a wrong token
    assert not fetcher._links and not buf._server._groups
    fetcher.fetch(desc, 0, into)
    with pytest.raises(TcpRefused, match="no buffer .* is served here"):
        fetcher.fetch({**desc, "id": "11" * 16}, 0, into)
    with pytest.raises(ValueError, match="does not fit in the nccl buffer"):
        fetcher.fetch(desc, (1 << 20) - 10, into)
    buf.tensor[:64] = 5
    fetcher.fetch(desc, 0, into)  # the refusals left the connection in step
    assert int(into.sum()) == 5 * 64 and len(buf._server._groups) == 1


def test_the_engine_receives_from_one_trainer_host_only(buf: nccl.NcclBuffer, fetcher) -> None:
    fetcher.fetch(_desc(buf), 0, torch.empty(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="receives only from '127.0.0.1'"):
        fetcher.fetch({**_desc(buf), "host": "127.0.0.2"}, 0, torch.empty(8, dtype=torch.uint8))


def test_a_receive_that_never_comes_is_bounded_and_the_next_bucket_joins_anew(
        buf: nccl.NcclBuffer, fetcher, monkeypatch: pytest.MonkeyPatch) -> None:
    desc = _desc(buf)
    into = torch.empty(64, dtype=torch.uint8)
    fetcher.fetch(desc, 0, into)
    (first,) = buf._server._groups.values()
    monkeypatch.setattr(nccl, "SEND_TIMEOUT_S", 1.0)
    send = nccl._HubHandler._send
    monkeypatch.setattr(nccl._HubHandler, "_send", lambda *args: time.sleep(3))  # a trainer that stalls
    started = time.monotonic()
    with pytest.raises((ConnectionError, TimeoutError)):
        fetcher.fetch(desc, 0, into)
    assert time.monotonic() - started < 2.5, "the receive waited past its bound"
    assert not fetcher._links, "the engine left the group it fell out of step with"
    monkeypatch.setattr(nccl._HubHandler, "_send", send)
    buf.tensor[:64] = 3
    assert waited(lambda: first.failed), "the trainer abandoned the group"
    fetcher.fetch(desc, 0, into)
    assert int(into.sum()) == 3 * 64 and first.name not in {g.name for g in buf._server._groups.values()}


DIES_AFTER_ASKING = """
import json, os, socket, sys
import torch
from titan_lora.transfer.transports import nccl
desc = json.loads(sys.argv[1])
fetcher = nccl.NcclFetcher()
fetcher.fetch(desc, 0, torch.empty(8, dtype=torch.uint8))          # joined, one bucket received
link = next(iter(fetcher._links.values()))
link.sock.sendall(nccl._REQUEST.pack(nccl.MAGIC, nccl._FETCH, bytes.fromhex(desc["id"]),
                                     bytes.fromhex(desc["token"]), 0, desc["size"], bytes(16)))
os._exit(0)                                                         # dies before it receives
"""


def test_a_worker_that_dies_mid_transfer_frees_the_trainer_in_bounded_time(buf: nccl.NcclBuffer) -> None:
    desc = _desc(buf)
    proc = subprocess.run([sys.executable, "-c", DIES_AFTER_ASKING, json.dumps(desc)], timeout=60,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert waited(lambda: not buf._server._groups, timeout_s=nccl.SEND_TIMEOUT_S / 2), \
        "the trainer still holds the dead worker's group"
    fetcher = nccl.NcclFetcher()
    try:
        buf.tensor[:16] = 1
        into = torch.empty(16, dtype=torch.uint8)
        fetcher.fetch(desc, 0, into)  # the hub serves the next incarnation
        assert int(into.sum()) == 16
    finally:
        fetcher.close()


def test_nccl_is_chosen_by_name_with_its_backend() -> None:
    choice = choose_transport("nccl", "http://127.0.0.1:8000", nccl_backend="gloo")
    assert choice == TransportChoice("nccl", (("host", "127.0.0.1"), ("port", 0), ("backend", "gloo")))
    b = choice.buffer(64, CPU)
    try:
        assert isinstance(b, nccl.NcclBuffer) and b.describe()["backend"] == "gloo"
    finally:
        b.close()


def test_the_groups_of_an_earlier_trainer_run_are_left_and_a_restart_on_the_same_port_is_joined(
        fetcher) -> None:
    ports = [free_port(), free_port()]
    into = torch.empty(16, dtype=torch.uint8)
    first = nccl.NcclBuffer(1 << 10, CPU, backend="gloo", port=ports[0])
    second = nccl.NcclBuffer(1 << 10, CPU, backend="gloo", port=ports[1])
    try:
        fetcher.fetch(_desc(first), 0, into)
        (old,) = fetcher._links.values()
        fetcher.fetch(_desc(second), 0, into)  # the next trainer run, on another port
        assert old.sock.fileno() == -1 and list(fetcher._links) == [("127.0.0.1", ports[1])], \
            "the earlier run's group is still held"
        assert waited(lambda: not first._server._groups), "and its trainer saw the worker leave"
        second.close()  # that run ends; the next one serves on the same port
        second = nccl.NcclBuffer(1 << 10, CPU, backend="gloo", port=ports[1])
        second.tensor[:16] = 4
        fetcher.fetch(_desc(second), 0, into)  # its connection read EOF: a new group, no failed bucket
        assert int(into.sum()) == 4 * 16
    finally:
        first.close()
        second.close()
