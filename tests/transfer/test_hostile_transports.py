"""Hostile peers against the trainer's two bucket ports, the tcp bucket server and the nccl hub (over its
gloo fallback, the same code as NCCL): silent, slow, oversized, deeply nested and keyless peers are each
refused or dropped within their deadline, the engine's legitimate transfer still goes through with all
of them connected, and once they went no thread, file descriptor or memory of theirs stays held."""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from dist_helpers import free_port
from wait_helpers import waited

from titan_lora.transfer.transports import nccl, tcp

CPU = torch.device("cpu")
AUTH_S = 2.0  # the authentication deadline under test: short, with margins a loaded machine keeps
SLACK_S = 3.0  # how late past a deadline a drop may be noticed here


def _threads() -> int:
    return threading.active_count()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@dataclasses.dataclass
class Port:
    """One listening port under attack, and how a legitimate engine and a hostile peer speak to it."""

    name: str
    buf: tcp.TcpBuffer
    magic: bytes
    fetch: Callable[[int, torch.Tensor], None]  # the legitimate engine's fetch
    request: Callable[..., bytes]  # a first request: id, token, offset or rank, nbytes or world

    @property
    def address(self) -> tuple[str, int]:
        desc = self.buf.describe(0)
        return desc["host"], desc["port"]

    def ids(self) -> tuple[bytes, bytes]:
        desc = self.buf.describe(0)
        return bytes.fromhex(desc["id"]), bytes.fromhex(desc["token"])

    def connect(self) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=10)
        return sock

    def legit(self) -> float:
        """A legitimate bucket through this port, checked byte for byte; its seconds."""
        self.buf.tensor[:4096] = torch.arange(4096).to(torch.uint8)
        out = torch.zeros(4096, dtype=torch.uint8)
        started = time.monotonic()
        self.fetch(0, out)
        assert torch.equal(out, self.buf.tensor[:4096]), f"{self.name}: the legitimate bucket came wrong"
        return time.monotonic() - started


@pytest.fixture(scope="module")
def warmed() -> None:
    """One legitimate transfer over each port first: what torch sets up once per process (gloo's and
    the TCPStore's, two pipe fds) is not any peer's."""
    for buf, fetcher in ((tcp.TcpBuffer(64, CPU), tcp.TcpFetcher()),
                         (nccl.NcclBuffer(64, CPU, backend="gloo", port=free_port()), nccl.NcclFetcher())):
        fetcher.fetch(buf.describe(0), 0, torch.empty(8, dtype=torch.uint8))
        fetcher.close()
        buf.close()


@pytest.fixture
def nothing_held(warmed: None) -> Iterator[None]:
    """Threads, fds and memory before the port opens; after it closed, all are back (within a bound)."""
    threads, fds, rss = _threads(), _fds(), _rss_mb()
    yield
    assert waited(lambda: _threads() <= threads, timeout_s=15), f"threads: {threads} before, {_threads()} after"
    assert waited(lambda: _fds() <= fds, timeout_s=15), f"fds: {fds} before, {_fds()} after"
    assert _rss_mb() - rss < 64, f"memory: {rss:.0f} MB before, {_rss_mb():.0f} MB after"


@pytest.fixture(params=["tcp", "nccl"])
def port(request: pytest.FixtureRequest, nothing_held: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[Port]:
    monkeypatch.setattr(tcp, "AUTH_TIMEOUT_S", AUTH_S, raising=False)
    if request.param == "tcp":
        buf = tcp.TcpBuffer(1 << 20, CPU, host="127.0.0.9")  # a server of its own
        fetcher = tcp.TcpFetcher(timeout_s=10)
        port = Port("tcp bucket server", buf, tcp.MAGIC, lambda offset, out: fetcher.fetch(buf.describe(0), offset, out),
                    lambda id_, token, a=0, b=64: tcp._REQUEST.pack(tcp.MAGIC, id_, token, a, b))
    else:
        buf = nccl.NcclBuffer(1 << 20, CPU, backend="gloo", port=free_port())
        fetcher = nccl.NcclFetcher()
        port = Port("nccl hub", buf, nccl.MAGIC, lambda offset, out: fetcher.fetch(buf.describe(0), offset, out),
                    lambda id_, token, a=0, b=1: nccl._REQUEST.pack(nccl.MAGIC, nccl._JOIN, id_, token, a, b,
                                                                   secrets.token_bytes(16)))
    try:
        yield port
    finally:
        fetcher.close()
        buf.close()


def _dropped(sock: socket.socket, within_s: float) -> tuple[bytes, float]:
    """(what the server said before it closed `sock`, seconds until it did); fails if it stays open."""
    started, said = time.monotonic(), b""
    sock.settimeout(within_s)
    try:
        while chunk := sock.recv(65536):
            said += chunk
    except (ConnectionResetError, BrokenPipeError):
        pass
    except TimeoutError:
        pytest.fail(f"the connection was still open after {within_s:.0f} s (it said {said!r})")
    return said, time.monotonic() - started


def _refusal(said: bytes, magic: bytes) -> str:
    assert said[:4] == magic, f"a refusal in another server's magic: {said[:40]!r}"
    return said[tcp._REPLY.size:].decode()


def test_silent_peers_past_every_cap_do_not_keep_the_engine_out(port: Port) -> None:
    silent = [port.connect() for _ in range(tcp.MAX_CONNECTIONS + 16)]
    try:
        assert port.legit() < 5, "the engine's fetch waited on the silent peers"
        for sock in silent:  # each evicted, or out of time: told why in this port's own words
            said, _ = _dropped(sock, AUTH_S + SLACK_S)
            assert "no request naming a served buffer" in _refusal(said, port.magic) or \
                "newer connections waited to authenticate" in _refusal(said, port.magic), said
            assert port.name in _refusal(said, port.magic)
    finally:
        for sock in silent:
            sock.close()
    assert port.legit() < 5


def test_a_slow_peer_is_dropped_at_its_deadline_not_at_the_idle_bound(port: Port) -> None:
    request = port.request(*port.ids())
    with port.connect() as sock:
        started = time.monotonic()
        sock.settimeout(0.2)
        said = b""
        for byte in request[:-1]:  # a valid request, a byte every 0.2 s: never whole within the deadline
            try:
                sock.sendall(bytes([byte]))
                said = sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                break
            break
        elapsed = time.monotonic() - started
    assert elapsed < AUTH_S + SLACK_S, f"a slow peer held its connection {elapsed:.1f} s"
    assert "within 2 s of connecting" in _refusal(said, port.magic)
    assert port.legit() < 5


def test_oversized_requests_are_refused_in_words_and_allocate_nothing(port: Port) -> None:
    id_, token = port.ids()
    rss = _rss_mb()
    with port.connect() as keyless, port.connect() as keyed:
        keyless.sendall(port.request(secrets.token_bytes(16), token, 0, 1 << 62))
        said, _ = _dropped(keyless, AUTH_S + SLACK_S) if port.name == "nccl hub" else (keyless.recv(4096), 0.0)
        assert "is served here" in _refusal(said, port.magic)
        keyed.sendall(port.request(id_, token, 1 << 40, 1 << 40))  # tcp: a range; nccl: a worker count
        keyed.settimeout(AUTH_S + SLACK_S)
        why = _refusal(keyed.recv(4096), port.magic)
        assert "past the end" in why or "is not a place in an engine" in why, why
    with port.connect() as blob:  # megabytes that are no request: the first header's worth decides
        try:
            blob.sendall(os.urandom(4 << 20))
        except OSError:
            pass  # dropped while still sending
        _dropped(blob, SLACK_S)
    assert _rss_mb() - rss < 32, "a refused size was allocated"
    assert port.legit() < 5


def test_a_deeply_nested_document_is_no_request_and_is_dropped_at_once(port: Port) -> None:
    with port.connect() as sock:
        try:
            sock.sendall(b"POST /titan/bucket HTTP/1.1\r\n\r\n" + b'{"a":' * 100_000 + b"1" + b"}" * 100_000)
        except OSError:
            pass
        said, elapsed = _dropped(sock, SLACK_S)
    assert not said.startswith(tcp.MAGIC + b"\x00"), "it was answered as a request"
    assert elapsed < SLACK_S
    assert port.legit() < 5


def test_keyless_peers_are_refused_and_never_count_against_the_cap(port: Port, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tcp, "MAX_CONNECTIONS", 2)
    id_, _ = port.ids()
    keyless = [port.connect() for _ in range(8)]
    try:
        for sock in keyless:
            sock.sendall(port.request(id_, secrets.token_bytes(16)))
            sock.settimeout(AUTH_S + SLACK_S)
            assert "wrong token" in _refusal(sock.recv(4096), port.magic)
        assert port.legit() < 5, "keyless peers took the slots of authenticated ones"
        for sock in keyless:  # refused, then held no longer than a silent peer
            _dropped(sock, AUTH_S + SLACK_S)
    finally:
        for sock in keyless:
            sock.close()


def test_past_the_cap_an_authenticated_connection_is_refused_in_its_ports_own_words(
        port: Port, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tcp, "MAX_CONNECTIONS", 1)
    port.legit()  # the engine's connection: authenticated, kept
    with port.connect() as sock:
        sock.sendall(port.request(*port.ids()))
        sock.settimeout(AUTH_S + SLACK_S)
        why = _refusal(sock.recv(4096), port.magic)
    assert f"the trainer's {port.name} serves 1 authenticated connections already" in why, why
    assert port.legit() < 5, "the engine's own connection is still served"
