"""The frame server: a connection is authenticated by a challenge-response before any request, only
the framed routes are served, each outcome gets the status the HTTP front gives it, and a bad frame is
answered, then the connection closed, without the route being called. Greetings have a deadline,
connections a cap, greeted connections an idle timeout."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator

import pytest

from titan_lora.engines.frame_server import FrameServer
from titan_lora.transfer.buckets import UnknownLayout
from titan_lora.transfer.frames import CLIENT, SERVER, connect, proof, proof_holds, recv_frame, send_frame

KEY = "frame-key"


def _bucket(body: dict) -> dict:
    calls.append(body)
    outcome = body.get("raise")
    if outcome is not None:
        raise {"value": ValueError("bad bucket"), "layout": UnknownLayout("layout abc"),
               "timeout": TimeoutError("too slow"), "bug": RuntimeError("engine bug")}[outcome]
    return {"tensors": 1, "echo": body}


calls: list[dict] = []


def _serve(**kwargs) -> FrameServer:
    routes = {"bucket": _bucket, "info": lambda body: {"incarnation": "x"}}
    srv = FrameServer(("127.0.0.1", 0), routes, KEY, max_frame_bytes=4096, incarnation="engine-1", **kwargs)
    srv.start()
    return srv


@pytest.fixture
def server() -> Iterator[FrameServer]:
    calls.clear()
    srv = _serve()
    yield srv
    srv.shutdown()
    srv.server_close()


def _session(srv: FrameServer, key: str = KEY) -> tuple[socket.socket, object, dict]:
    """A connection greeted with `key`: the socket, its reader and the server's last greeting frame."""
    sock = connect("127.0.0.1", srv.port, timeout_s=10)
    reader = sock.makefile("rb")
    theirs = recv_frame(reader, 4096)["challenge"]
    send_frame(sock, {"challenge": "c1", "proof": proof(key, CLIENT, theirs, "c1")})
    hello = recv_frame(reader, 4096)
    if hello.get("status") == 200:
        assert proof_holds(KEY, SERVER, ("c1", theirs, "engine-1"), hello.pop("proof")), "the server proved itself"
    return sock, reader, hello


def test_a_wrong_key_is_refused_and_the_connection_closed_before_any_request(server: FrameServer) -> None:
    sock, reader, hello = _session(server, "wrong")
    assert hello == {"status": 401, "error": "missing or wrong API key", "close": True}
    try:
        send_frame(sock, {"route": "bucket", "body": {}})
    except OSError:
        pass  # the server may already have closed its end
    assert recv_frame(reader, 4096) is None and calls == []


def test_routes_answer_as_over_http_and_the_connection_serves_on_after_an_error(server: FrameServer) -> None:
    sock, reader, hello = _session(server)
    assert hello == {"status": 200, "incarnation": "engine-1", "idle_timeout_s": 300.0}

    def ask(route: str, body: object) -> dict:
        send_frame(sock, {"route": route, "body": body})
        return recv_frame(reader, 1 << 20)

    assert ask("bucket", {"n": 1}) == {"status": 200, "body": {"tensors": 1, "echo": {"n": 1}}}
    assert ask("bucket", {"raise": "value"}) == {"status": 400, "error": "ValueError: bad bucket"}
    assert ask("bucket", {"raise": "layout"})["status"] == 409
    assert ask("bucket", {"raise": "timeout"}) == {"status": 504, "error": "TimeoutError: too slow"}
    assert ask("bucket", {"raise": "bug"}) == {"status": 500, "error": "RuntimeError: engine bug"}
    # INFO makes the offer and carries the nonce: it is served over HTTP only.
    assert ask("info", {}) == {"status": 404, "error": "unknown route /titan/info"}
    assert ask("bucket", [1]) == {"status": 400, "error": "a request's body must be a JSON object, got list"}
    assert ask(["bucket"], {}) == {"status": 400, "error": "a request's route must be a string, got list"}
    assert ask("bucket", {"n": 2})["status"] == 200, "the same connection still serves"
    assert [c.get("n") for c in calls] == [1, None, None, None, None, 2]
    sock.close()


def test_a_frame_over_the_cap_is_answered_413_and_the_connection_closed_unread(server: FrameServer) -> None:
    sock, reader, _ = _session(server)
    sock.sendall(struct.pack(">I", 1 << 20))  # announced, never sent: a server reading it would hang
    reply = recv_frame(reader, 4096)
    assert reply["status"] == 413 and reply["close"] and "over the limit of 4096 bytes" in reply["error"]
    assert "--max-body-mb" in reply["error"], "the engine's reply names the flag that sets the cap"
    assert recv_frame(reader, 4096) is None and calls == []
    sock.close()


def test_a_peer_that_never_greets_is_dropped() -> None:
    srv = _serve(greeting_timeout_s=0.5)
    sock = connect("127.0.0.1", srv.port, timeout_s=10)
    reader = sock.makefile("rb")
    assert "challenge" in recv_frame(reader, 4096)
    assert recv_frame(reader, 4096) is None, "the server closed the silent connection"
    assert calls == []
    sock.close()
    srv.shutdown()
    srv.server_close()


def test_a_greeting_trickled_a_byte_at_a_time_is_dropped_at_its_deadline() -> None:
    """A per-read timeout never fires on a peer that sends a byte every 0.2 s: the greeting has a deadline."""
    srv = _serve(greeting_timeout_s=1.0)
    sock = connect("127.0.0.1", srv.port, timeout_s=10)
    reader = sock.makefile("rb")
    recv_frame(reader, 4096)
    started, dropped = time.monotonic(), False
    for byte in struct.pack(">I", 200) + b"x" * 40:  # bounded: 44 bytes, 8.8 s at most
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            dropped = True
            break
        time.sleep(0.2)
        if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
            dropped = True
            break
    assert dropped and time.monotonic() - started < 3.0, "dropped at the 1 s deadline, not per read"
    sock.close()
    srv.shutdown()
    srv.server_close()


def test_a_deeply_nested_frame_is_answered_400_and_the_connection_closed(server: FrameServer) -> None:
    for greeted in (False, True):
        if greeted:
            sock, reader, _ = _session(server)
        else:
            sock = connect("127.0.0.1", server.port, timeout_s=10)
            reader = sock.makefile("rb")
            recv_frame(reader, 4096)
        data = b"[" * 4000
        sock.sendall(struct.pack(">I", len(data)) + data)
        reply = recv_frame(reader, 4096)
        assert reply["status"] == 400 and reply["close"] and "not valid JSON" in reply["error"]
        assert recv_frame(reader, 4096) is None
        sock.close()
    assert calls == []


def test_connections_over_the_cap_are_refused_503_at_once() -> None:
    srv = _serve(max_connections=2)
    held = [connect("127.0.0.1", srv.port, timeout_s=10) for _ in range(2)]
    for sock in held:
        assert "challenge" in recv_frame(sock.makefile("rb"), 4096)
    extra = connect("127.0.0.1", srv.port, timeout_s=10)
    reply = recv_frame(extra.makefile("rb"), 4096)
    assert reply["status"] == 503 and reply["close"] and "--max-connections" in reply["error"]
    for sock in (*held, extra):
        sock.close()
    for _ in range(100):  # the slots are given back as their threads end
        if srv.live_connections() == 0:
            break
        time.sleep(0.05)
    sock, _, hello = _session(srv)
    assert hello["status"] == 200, "a freed slot takes the next connection"
    sock.close()
    srv.shutdown()
    srv.server_close()


def test_a_greeted_connection_idle_past_its_timeout_is_closed() -> None:
    srv = _serve(idle_timeout_s=0.5)
    sock, reader, hello = _session(srv)
    assert hello["idle_timeout_s"] == 0.5
    started = time.monotonic()
    assert recv_frame(reader, 4096) is None and time.monotonic() - started < 3.0
    sock.close()
    srv.shutdown()
    srv.server_close()
