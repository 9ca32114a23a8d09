"""Framed JSON on one kept TCP connection: the transfer routes without HTTP's per-request parsing.

A sync's hot path is one bucket request and its ack. Over Python's HTTP client and server, building,
parsing and answering that request cost about 0.6 ms of a 1.3 ms sync on an H200 host (measured with
perf_counter stamps on both sides), several times the engine's own work on the bucket. An engine that
serves frames names their port in INFO (`FRAMES_PORT`); the trainer then sends the routes in
`protocol.FRAMED_ROUTES` as frames, and everything else (INFO and its nonce check, rollouts) over HTTP.

Wire: every message is a 4-byte big-endian length, then that many bytes of UTF-8 JSON (an object).
The client's first frame is `{"api_key": KEY}`; the server answers `{"status": 200, "incarnation":
ID}` (the engine's, as INFO names it), or 401 and closes. Then each request is `{"route": ROUTE,
"body": {...}}`, and each reply `{"status": 200, "body": {...}}` or `{"status": CODE, "error":
MESSAGE}`, CODE being the HTTP status the HTTP front answers the same request with; a reply with
`"close": true` is the connection's last. Both sides import this module: it holds no trainer or
engine code.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import IO, Any

FRAMES_PORT = "frames_port"
"""The INFO field that offers frames: the port they are served on (absent: HTTP only)."""
HELLO_MAX_BYTES = 4096
_LENGTH = struct.Struct(">I")


class FrameError(ValueError):
    """A frame that cannot be read: cut short, over the size limit, or not a JSON object."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def send_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    """Write `message` as one frame, in one send (no small write waits for a delayed ack)."""
    data = json.dumps(message).encode()
    sock.sendall(_LENGTH.pack(len(data)) + data)


def recv_frame(reader: IO[bytes], max_bytes: int) -> dict[str, Any] | None:
    """The next frame's object from `reader` (a buffered reader of the socket); None when the peer
    closed between frames."""
    head = reader.read(_LENGTH.size)
    if not head:
        return None
    if len(head) < _LENGTH.size:
        raise FrameError("the connection closed inside a frame's length")
    (length,) = _LENGTH.unpack(head)
    if length > max_bytes:
        raise FrameError(f"a frame of {length} bytes is over the limit of {max_bytes} bytes", status=413)
    data = reader.read(length)
    if len(data) < length:
        raise FrameError(f"the connection closed {len(data)} bytes into a frame of {length}")
    try:
        message = json.loads(data)
    except ValueError as err:
        raise FrameError(f"a frame is not valid JSON: {err}") from None
    if not isinstance(message, dict):
        raise FrameError(f"a frame must hold a JSON object, got {type(message).__name__}")
    return message


def connect(host: str, port: int, timeout_s: float) -> socket.socket:
    """A TCP connection to `host:port` with Nagle off (each frame is one small write)."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
