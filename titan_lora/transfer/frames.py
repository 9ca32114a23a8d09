"""Framed JSON on one kept TCP connection: the transfer routes without HTTP's per-request parsing.

A sync's hot path is one bucket request and its ack. Over Python's HTTP client and server, building,
parsing and answering that request cost about 0.6 ms of a 1.3 ms sync on an H200 host (measured with
perf_counter stamps on both sides), several times the engine's own work on the bucket. An engine that
serves frames names their port in INFO (`FRAMES_PORT`); the trainer then sends the routes in
`protocol.FRAMED_ROUTES` as frames, and everything else (INFO and its nonce check, rollouts) over HTTP.

Wire: every message is a 4-byte big-endian length, then that many bytes of UTF-8 JSON (an object).
The key never crosses the wire, so a process that took the port of a dead engine learns nothing from
a trainer that connects (challenge-response, each side proving it holds the key with an HMAC over
nonces both chose, `proof`):

    server: {"challenge": NS}                    (on accept; or {"status": 503, ..., "close": true})
    client: {"challenge": NC, "proof": proof(KEY, CLIENT, NS, NC)}
    server: {"status": 200, "incarnation": ID, "idle_timeout_s": T, "proof": proof(KEY, SERVER, NC, NS, ID)}
            or {"status": 401, ..., "close": true}

ID is the engine's incarnation, as INFO names it; the client checks the server's proof before it sends
any request, and reconnects rather than reuse a connection idle for T/2 (the server drops it after T).
Then each request is `{"route": ROUTE, "body": {...}}`, and each reply `{"status": 200, "body": {...}}`
or `{"status": CODE, "error": MESSAGE}`, CODE being the HTTP status the HTTP front answers the same
request with; a reply with `"close": true` is the connection's last. Both sides import this module:
it holds no trainer or engine code.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import struct
import time
from collections.abc import Callable
from typing import IO, Any

FRAMES_PORT = "frames_port"
"""The INFO field that offers frames: the port they are served on (absent: HTTP only)."""
HELLO_MAX_BYTES = 4096
"""The cap of every greeting frame, both ways."""
CLIENT, SERVER = "titan-frames client", "titan-frames server"
"""The role each proof names, so that one side's proof can never be replayed as the other's."""
_LENGTH = struct.Struct(">I")


class FrameError(ValueError):
    """A frame that cannot be read: cut short, over the size limit, or not a JSON object."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def encode_frame(message: dict[str, Any]) -> bytes:
    """`message` as one frame's bytes."""
    data = json.dumps(message).encode()
    return _LENGTH.pack(len(data)) + data


def send_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    """Write `message` as one frame, in one send (no small write waits for a delayed ack)."""
    sock.sendall(encode_frame(message))


def recv_frame(reader: IO[bytes], max_bytes: int) -> dict[str, Any] | None:
    """The next frame's object from `reader` (a buffered reader of the socket); None when the peer
    closed between frames."""
    return _read_frame(reader.read, max_bytes)


def recv_frame_by(sock: socket.socket, max_bytes: int, deadline: float) -> dict[str, Any] | None:
    """`recv_frame` read straight from `sock`, the whole frame by `deadline` (`time.monotonic()`): a peer
    that sends a byte now and then cannot stretch a greeting (TimeoutError past it)."""
    return _read_frame(lambda n: _recv_by(sock, n, deadline), max_bytes)


def _recv_by(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Up to `n` bytes (fewer only when the peer closed), each read given what is left of `deadline`."""
    chunks, got = [], 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{got} of {n} bytes came before the deadline")
        sock.settimeout(left)
        chunk = sock.recv(min(n - got, 1 << 16))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _read_frame(read: Callable[[int], bytes], max_bytes: int) -> dict[str, Any] | None:
    head = read(_LENGTH.size)
    if not head:
        return None
    if len(head) < _LENGTH.size:
        raise FrameError("the connection closed inside a frame's length")
    (length,) = _LENGTH.unpack(head)
    if length > max_bytes:
        raise FrameError(f"a frame of {length} bytes is over the limit of {max_bytes} bytes", status=413)
    data = read(length)
    if len(data) < length:
        raise FrameError(f"the connection closed {len(data)} bytes into a frame of {length}")
    try:
        message = json.loads(data)
    except (ValueError, RecursionError) as err:  # RecursionError: arrays nested thousands deep
        raise FrameError(f"a frame is not valid JSON: {err}") from None
    if not isinstance(message, dict):
        raise FrameError(f"a frame must hold a JSON object, got {type(message).__name__}")
    return message


def new_challenge() -> str:
    """A fresh nonce for one greeting."""
    return secrets.token_hex(16)


def proof(key: str, role: str, *nonces: str) -> str:
    """HMAC-SHA256 under `key` of `role` (CLIENT or SERVER) and `nonces`: shows the key is known,
    reveals nothing of it, and holds for this one greeting only."""
    message = json.dumps([role, *nonces]).encode()
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


def proof_holds(key: str, role: str, nonces: tuple[str, ...], shown: object) -> bool:
    """Whether `shown` is `proof(key, role, *nonces)` (compared in constant time)."""
    return isinstance(shown, str) and hmac.compare_digest(proof(key, role, *nonces).encode(), shown.encode())


def connect(host: str, port: int, timeout_s: float) -> socket.socket:
    """A TCP connection to `host:port` with Nagle off (each frame is one small write)."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
