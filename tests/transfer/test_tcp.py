"""The tcp transport in isolation: a trainer-side buffer served by this process's bucket server, fetched
by the engine side through `BucketDesc.receive_into` (bytes, checksum, no stale copy), and every refusal:
a wrong token, an unknown buffer, a range past the end, a short read, a silent server."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import torch
from dist_helpers import free_port

from titan_lora.transfer.buckets import bucket_checksum, bucket_size, copy_out, pack, plan_buckets
from titan_lora.transfer.placement import choose_transport, transport_kind
from titan_lora.transfer.transport import BufferCache, TransportChoice, lend_buffer, make_buffers
from titan_lora.transfer.transports.base import BucketDesc
from titan_lora.transfer.transports import tcp

CPU = torch.device("cpu")


def _received(cache: BufferCache, desc: dict, nbytes: int) -> torch.Tensor:
    """The `nbytes` bytes of the bucket `desc` names, as the engine receives them into its slab."""
    into = torch.empty(nbytes, dtype=torch.uint8)
    BucketDesc.parse(desc).receive_into(into, cache)
    return into


@pytest.fixture
def buf():
    b = tcp.TcpBuffer(1 << 20, CPU)
    yield b
    b.close()


def _over_json(desc: dict) -> dict:
    return json.loads(json.dumps(desc))


def test_a_bucket_fetched_over_tcp_has_the_trainers_bytes_and_checksum(buf: tcp.TcpBuffer) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(37 * (i + 1), generator=g) for i in range(5)}
    entries = plan_buckets(tensors, 1 << 20)[0]
    offset = 4096  # a bucket in the middle of the buffer, as the gatherer's lent buffer holds them
    pack(buf.tensor[offset:], entries, tensors)
    sent = bucket_checksum(buf.tensor[offset : offset + bucket_size(entries)])
    desc = _over_json(buf.describe(offset))
    assert set(desc) == {"kind", "host", "port", "id", "token", "size", "offset"} and desc["kind"] == "tcp"
    cache = BufferCache()
    owned, views = copy_out(_received(cache, desc, bucket_size(entries)), entries)
    assert bucket_checksum(owned) == sent
    for name, t in tensors.items():
        assert torch.equal(views[name], t), name
    assert len(cache) == 0, "a fetched buffer is never cached"


def test_every_bucket_is_fetched_anew_never_from_an_earlier_copy(buf: tcp.TcpBuffer) -> None:
    cache = BufferCache()
    desc = _over_json(buf.describe(0))
    buf.tensor[:1000] = 7
    assert int(_received(cache, desc, 1000).sum()) == 7000
    buf.tensor[:1000] = 9  # the trainer reuses the buffer for the next bucket, same descriptor
    assert int(_received(cache, desc, 1000).sum()) == 9000


def test_connections_are_kept_and_reused(buf: tcp.TcpBuffer) -> None:
    fetcher = tcp.TcpFetcher()
    desc = buf.describe(0)
    addr = (desc["host"], desc["port"])
    fetcher.fetch(desc, 0, torch.empty(10, dtype=torch.uint8))
    kept = fetcher._idle[addr][0]
    fetcher.fetch(desc, 10, torch.empty(10, dtype=torch.uint8))
    assert fetcher._idle[addr] == [kept], "the second fetch went over the first connection"


def test_a_kept_connection_the_peer_closed_is_replaced(buf: tcp.TcpBuffer) -> None:
    fetcher = tcp.TcpFetcher()
    desc = buf.describe(0)
    buf.tensor[:64] = 3
    with socket.create_server(("127.0.0.1", 0)) as closer:  # accepts, then hangs up
        dead = socket.create_connection(closer.getsockname())
        closer.accept()[0].close()
        fetcher._idle[(desc["host"], desc["port"])] = [dead]
        out = torch.empty(64, dtype=torch.uint8)
        fetcher.fetch(desc, 0, out)
    assert int(out.sum()) == 3 * 64


def test_a_wrong_token_or_an_unknown_buffer_is_refused(buf: tcp.TcpBuffer) -> None:
    desc = buf.describe(0)
    out = torch.empty(16, dtype=torch.uint8)
    with pytest.raises(tcp.TcpRefused, match=f"wrong token for buffer {desc['id']}"):
        tcp.TcpFetcher().fetch({**desc, "token": "00" * 16}, 0, out)
    with pytest.raises(tcp.TcpRefused, match="no buffer 0{32} is served here"):
        tcp.TcpFetcher().fetch({**desc, "id": "00" * 16}, 0, out)
    buf.unlink()
    with pytest.raises(tcp.TcpRefused, match=f"no buffer {desc['id']} is served here"):
        tcp.TcpFetcher().fetch(desc, 0, out)
    with pytest.raises(ValueError, match="'token' must be 32 hex digits"):
        tcp.TcpFetcher().fetch({**desc, "token": "zz"}, 0, out)


def test_a_range_past_the_end_is_refused_on_both_sides(buf: tcp.TcpBuffer) -> None:
    desc = buf.describe(0)
    with pytest.raises(ValueError, match=r"a bucket of 16 bytes at offset 1048570 does not fit"):
        _received(BufferCache(), {**desc, "offset": (1 << 20) - 6}, 16)
    # An engine told a larger size than the trainer holds: the server checks against the real one.
    with pytest.raises(tcp.TcpRefused, match=r"bytes \[1048570, 1048586\) are past the end .* \(1048576 bytes\)"):
        tcp.TcpFetcher().fetch({**desc, "size": 1 << 21}, (1 << 20) - 6, torch.empty(16, dtype=torch.uint8))


def _fake_server(reply: bytes, close: bool) -> tuple[socket.socket, threading.Event]:
    """A server that reads one request, sends `reply`, then closes (or keeps silent)."""
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        conn.recv(tcp._REQUEST.size)
        conn.sendall(reply)
        if close:
            conn.close()
        done.wait(10)
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return listener, done


def _desc_at(listener: socket.socket) -> dict:
    return {"kind": "tcp", "host": "127.0.0.1", "port": listener.getsockname()[1], "id": "11" * 16,
            "token": "22" * 16, "size": 1 << 20, "offset": 0}


def test_a_short_read_is_an_error() -> None:
    listener, done = _fake_server(tcp._REPLY.pack(tcp.MAGIC, 0, 1000) + b"x" * 600, close=True)
    with listener, pytest.raises(ConnectionError, match="short read: 600 of 1000 bytes of the bucket"):
        tcp.TcpFetcher().fetch(_desc_at(listener), 0, torch.empty(1000, dtype=torch.uint8))
    done.set()


def test_a_silent_server_times_out() -> None:
    listener, done = _fake_server(tcp._REPLY.pack(tcp.MAGIC, 0, 1000) + b"x" * 10, close=False)
    started = time.perf_counter()
    with listener, pytest.raises(TimeoutError, match="sent 10 of 1000 bytes of the bucket in time"):
        tcp.TcpFetcher(timeout_s=0.5).fetch(_desc_at(listener), 0, torch.empty(1000, dtype=torch.uint8))
    assert time.perf_counter() - started < 5
    done.set()


def test_an_unreachable_trainer_names_the_address_to_fix() -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]  # closed when the block ends: nothing listens there
    desc = {"kind": "tcp", "host": "127.0.0.1", "port": port, "id": "11" * 16, "token": "22" * 16, "size": 64}
    with pytest.raises(ConnectionError, match=rf"cannot reach .* at 127.0.0.1:{port} .*\[engine\] tcp_host"):
        tcp.TcpFetcher().fetch(desc, 0, torch.empty(8, dtype=torch.uint8))


def test_the_emitters_buffers_and_the_lent_one_are_tcp_when_chosen() -> None:
    choice = choose_transport("tcp", "http://127.0.0.1:8000")
    assert choice == TransportChoice("tcp", (("host", "127.0.0.1"), ("port", 0)))
    bufs = make_buffers(2, 4096, CPU, choice)
    tensor, home = lend_buffer(10, torch.float32, CPU, choice)
    try:
        assert all(isinstance(b, tcp.TcpBuffer) for b in [*bufs, home]) and not tensor.any()
        assert len({b.describe()["port"] for b in [*bufs, home]}) == 1, "one server per address"
        assert len({b.describe()["token"] for b in [*bufs, home]}) == 3, "a token per buffer"
    finally:
        for b in bufs:
            b.close()


def test_auto_keeps_the_device_default_on_this_host_and_takes_tcp_elsewhere() -> None:
    assert transport_kind("auto", "") is None, "an engine titan_lora starts runs here"
    assert transport_kind("auto", "http://127.0.0.1:8000") is None
    assert transport_kind("auto", "http://localhost:8000") is None
    assert transport_kind("auto", "http://192.0.2.7:8000") == "tcp", "TEST-NET-1: never this host"
    assert transport_kind("shm", "http://192.0.2.7:8000") == "shm", "a named transport is taken as is"
    assert choose_transport("auto", "http://192.0.2.7:8000", "10.1.2.3", 7000) == \
        TransportChoice("tcp", (("host", "10.1.2.3"), ("port", 7000)))
    assert choose_transport("cuda_ipc", "") == TransportChoice("cuda_ipc")
    with pytest.raises(ValueError, match="unknown bucket transport 'rdma': this process has cuda_ipc, nccl, shm, tcp"):
        transport_kind("rdma", "")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_cuda_buffer_is_staged_to_host_and_served() -> None:
    b = tcp.TcpBuffer(1 << 16, torch.device("cuda"))
    try:
        b.tensor.copy_(torch.arange(1 << 16, device="cuda").to(torch.uint8))
        b.synchronize()
        got = _received(BufferCache(), b.describe(128), 4096)
        assert torch.equal(got, b.tensor[128 : 128 + 4096].cpu())
    finally:
        b.close()



def test_unauthenticated_connections_are_capped_evicted_and_dropped_each_told_why(
        buf: tcp.TcpBuffer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tcp, "AUTH_TIMEOUT_S", 2.0)
    monkeypatch.setattr(tcp, "MAX_PENDING", 4)
    desc = buf.describe(0)
    stalled = [socket.create_connection((desc["host"], desc["port"])) for _ in range(20)]
    try:
        for s in stalled:
            s.sendall(b"TL")  # 2 bytes of a request header, then nothing
            s.settimeout(15.0)  # a handler that never ends its stalled read fails the recv below
        replies = [s.recv(4096) for s in stalled]
        assert all(r.startswith(tcp.MAGIC) for r in replies), "every one is told why, in the server's magic"
        evicted = [r for r in replies if b"while 4 newer connections waited to authenticate" in r]
        timed_out = [r for r in replies if b"within 2 s of connecting" in r]
        assert (len(evicted), len(timed_out)) == (16, 4), "the oldest past MAX_PENDING go first, the rest in time"
        assert all(s.recv(10) == b"" for s in stalled), "and each is closed"
    finally:
        for s in stalled:
            s.close()
    buf.tensor[:8] = 5
    out = torch.empty(8, dtype=torch.uint8)
    tcp.TcpFetcher().fetch(desc, 0, out)
    assert int(out.sum()) == 40, "the server still serves after the stalled ones went"


def test_keepalive_is_on_for_both_ends(buf: tcp.TcpBuffer) -> None:
    fetcher, desc = tcp.TcpFetcher(), buf.describe(0)
    fetcher.fetch(desc, 0, torch.empty(4, dtype=torch.uint8))
    kept = fetcher._idle[(desc["host"], desc["port"])][0]
    assert kept.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
    served = list(buf._server._handlers.values())
    assert served and all(s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) for s in served)


@pytest.fixture
def own_server_buf():
    """A buffer on a server of its own (servers are shared per address, and keep their staging buffer)."""
    b = tcp.TcpBuffer(1 << 20, CPU, host="127.0.0.7")
    yield b
    b.close()


def test_cuda_ranges_go_through_one_fixed_staging_buffer(own_server_buf: tcp.TcpBuffer,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path's logic on host memory: every range is staged, the staging never grows."""
    allocated: list[int] = []
    monkeypatch.setattr(tcp, "_needs_staging", lambda view: True)
    monkeypatch.setattr(tcp, "_pinned", lambda n: allocated.append(n) or torch.empty(n, dtype=torch.uint8))
    monkeypatch.setattr(tcp, "STAGING_BYTES", 1000)
    buf = own_server_buf
    buf.tensor.copy_(torch.arange(buf.size).to(torch.uint8))
    desc, results = buf.describe(0), {}

    def fetch(i: int) -> None:
        out = torch.empty(4096 + i * 777, dtype=torch.uint8)
        tcp.TcpFetcher().fetch(desc, 100 * i, out)
        results[i] = torch.equal(out, buf.tensor[100 * i : 100 * i + out.numel()])

    threads = [threading.Thread(target=fetch, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == {i: True for i in range(6)}
    assert allocated == [1000], "one staging buffer per server, of STAGING_BYTES, whatever the ranges"


def test_a_server_stops_when_its_last_buffer_closes() -> None:
    first = tcp.TcpBuffer(64, CPU, host="127.0.0.5")
    second = tcp.TcpBuffer(64, CPU, host="127.0.0.5")
    desc = first.describe(0)
    fetcher = tcp.TcpFetcher()
    fetcher.fetch(desc, 0, torch.empty(8, dtype=torch.uint8))  # leaves a kept connection being served
    handlers = list(first._server._handlers)
    first.close()
    fetcher.fetch(second.describe(0), 0, torch.empty(8, dtype=torch.uint8))
    second.close()
    assert (tcp._BucketServer, "127.0.0.5", 0) not in tcp._SERVERS
    assert not any(t.is_alive() for t in handlers), "the idle connection's handler was ended and joined"
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.5", desc["port"]), timeout=2).close()


def _has_ipv6_loopback() -> bool:
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
def test_an_ipv6_host_is_served() -> None:
    b = tcp.TcpBuffer(64, CPU, host="::1")
    try:
        b.tensor[:] = 6
        out = torch.empty(64, dtype=torch.uint8)
        tcp.TcpFetcher().fetch(json.loads(json.dumps(b.describe(0))), 0, out)
        assert b.describe()["host"] == "::1" and int(out.sum()) == 6 * 64
    finally:
        b.close()


def test_a_refusal_too_long_to_read_whole_closes_the_connection() -> None:
    why = b"r" * 5000
    listener, done = _fake_server(tcp._REPLY.pack(tcp.MAGIC, 1, len(why)) + why, close=False)
    fetcher, desc = tcp.TcpFetcher(), _desc_at(listener)
    with listener, pytest.raises(tcp.TcpRefused, match="refused: r{4096}$"):
        fetcher.fetch(desc, 0, torch.empty(8, dtype=torch.uint8))
    assert not fetcher._idle.get(("127.0.0.1", desc["port"])), "a connection out of step is not kept"
    done.set()


def test_a_kept_socket_that_fails_is_replaced_once(buf: tcp.TcpBuffer) -> None:
    fetcher, desc = tcp.TcpFetcher(), buf.describe(0)
    broken = socket.socket()
    broken.close()  # any OSError, not only a reset: here EBADF
    fetcher._idle[(desc["host"], desc["port"])] = [broken]
    buf.tensor[:16] = 2
    out = torch.empty(16, dtype=torch.uint8)
    fetcher.fetch(desc, 0, out)
    assert int(out.sum()) == 32


def test_the_engine_fetches_only_from_the_first_trainer_host_that_served_it(buf: tcp.TcpBuffer) -> None:
    fetcher, desc = tcp.TcpFetcher(), buf.describe(0)
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    with pytest.raises(ConnectionError):
        fetcher.fetch({**desc, "host": "127.0.0.2", "port": port}, 0, torch.empty(8, dtype=torch.uint8))
    assert fetcher.trainer_host is None, "a failed fetch pins nothing"
    fetcher.fetch(desc, 0, torch.empty(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="names trainer host '127.0.0.2', but this engine fetches only from "
                                         "'127.0.0.1'.*restart the engine"):
        fetcher.fetch({**desc, "host": "127.0.0.2"}, 0, torch.empty(8, dtype=torch.uint8))


def test_kept_connections_to_an_earlier_trainer_run_or_that_read_eof_are_closed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tcp, "IDLE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(tcp, "AUTH_TIMEOUT_S", 0.5, raising=False)
    fetcher = tcp.TcpFetcher()
    runs = [tcp.TcpBuffer(4096, CPU, host="127.0.0.6", port=free_port()) for _ in range(2)]  # two trainer runs
    try:
        first = runs[0].describe(0)
        addr = ("127.0.0.6", first["port"])
        fetcher.fetch(first, 0, torch.empty(8, dtype=torch.uint8))
        for _ in range(2):  # more kept connections, as concurrent buckets leave them
            fetcher._keep(addr, fetcher._connect(addr, time.monotonic() + 5))
        kept = list(fetcher._idle[addr])
        assert len(kept) == 3
        time.sleep(2.0)  # the server ends them all: each reads EOF now
        fetcher.fetch(first, 0, torch.empty(8, dtype=torch.uint8))
        assert all(s.fileno() == -1 for s in kept), "a kept connection that read EOF stays open"
        (fresh,) = fetcher._idle[addr]
        second = runs[1].describe(0)
        fetcher.fetch(second, 0, torch.empty(8, dtype=torch.uint8))  # the next trainer run
        assert fresh.fileno() == -1, "the earlier run's connection stays open"
        assert [k for k, v in fetcher._idle.items() if v] == [("127.0.0.6", second["port"])]
    finally:
        fetcher.close()
        for b in runs:
            b.close()
