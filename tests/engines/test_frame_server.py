"""The frame server: a connection is authenticated by its first frame, only the framed routes are
served, each outcome gets the status the HTTP front gives it, and a bad frame is answered, then the
connection closed, without the route being called."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator

import pytest

from titan_lora.engines.frame_server import FrameServer
from titan_lora.transfer.buckets import UnknownLayout
from titan_lora.transfer.frames import connect, recv_frame, send_frame

KEY = "frame-key"


def _bucket(body: dict) -> dict:
    calls.append(body)
    outcome = body.get("raise")
    if outcome is not None:
        raise {"value": ValueError("bad bucket"), "layout": UnknownLayout("layout abc"),
               "timeout": TimeoutError("too slow"), "bug": RuntimeError("engine bug")}[outcome]
    return {"tensors": 1, "echo": body}


calls: list[dict] = []


@pytest.fixture
def server() -> Iterator[FrameServer]:
    calls.clear()
    routes = {"bucket": _bucket, "info": lambda body: {"incarnation": "x"}}
    srv = FrameServer(("127.0.0.1", 0), routes, KEY, max_frame_bytes=4096, incarnation="engine-1")
    thread = srv.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(5)


def _session(srv: FrameServer, key: str = KEY) -> tuple[socket.socket, object, dict]:
    sock = connect("127.0.0.1", srv.port, timeout_s=10)
    reader = sock.makefile("rb")
    send_frame(sock, {"api_key": key})
    return sock, reader, recv_frame(reader, 4096)


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
    assert hello == {"status": 200, "incarnation": "engine-1"}

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


def test_a_peer_that_never_greets_is_dropped(server: FrameServer, monkeypatch) -> None:
    from titan_lora.engines import frame_server

    monkeypatch.setattr(frame_server, "HELLO_TIMEOUT_S", 0.2)
    sock = connect("127.0.0.1", server.port, timeout_s=10)
    reader = sock.makefile("rb")
    assert recv_frame(reader, 4096) is None, "the server closed the silent connection"
    assert calls == []
    sock.close()
