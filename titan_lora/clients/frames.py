"""The trainer's end of an engine's frame server (`transfer.frames`): one kept connection per thread.

`JsonClient` sends the routes of `protocol.FRAMED_ROUTES` through a `FrameChannel` once the engine's
INFO offered one. A connection counts only if its greeting proves the engine holds the key (the key
itself is never sent: a process that took a dead engine's port learns nothing) and names the
incarnation that INFO named: a port can outlive its engine. A kept connection idle for half the
server's idle timeout, or that the server closed meanwhile, is replaced before a request goes out.
A request is never sent twice: once it went out (or was being sent), a broken connection raises
EngineUnreachable, since the engine may have acted on it (the syncer then checks the engine and sends
again as a whole). Only a connection that could not be made or greeted
raises FrameRefused, with nothing sent, so that the caller may go over HTTP instead.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from typing import IO, Any

from titan_lora.clients.sockets import OpenSockets
from titan_lora.transfer.errors import EngineHung, EngineUnreachable
from titan_lora.transfer.frames import (
    CLIENT,
    HELLO_MAX_BYTES,
    SERVER,
    FrameError,
    connect,
    new_challenge,
    proof,
    proof_holds,
    recv_frame,
    recv_frame_by,
    send_frame,
)

MAX_REPLY_BYTES = 64 * 2**20
CONNECT_TIMEOUT_S = 5.0
"""For the connection and its greeting: a frames port behind a firewall that drops packets costs this
once, not a whole request timeout, before the request goes over HTTP."""


class FrameRefused(EngineUnreachable):
    """No frame connection could be made or greeted (nothing was sent): HTTP may still reach the engine."""


class FrameChannel:
    """Requests as frames to `host:port` of the engine `incarnation`, authenticated with `api_key`;
    `where` names it in errors."""

    def __init__(self, host: str, port: int, api_key: str, incarnation: str, where: str) -> None:
        self.host, self.port = host, port
        self.api_key = api_key
        self.incarnation = incarnation
        self.where = where
        self._local = threading.local()
        self.open = OpenSockets()  # every thread's connection, for `interrupt`

    def _connection(self, timeout_s: float) -> tuple[socket.socket, IO[bytes]]:
        held = getattr(self._local, "conn", None)
        if held is not None and (time.monotonic() > self._local.fresh_until or _closed(held[0])):
            self.close()  # nothing was sent on it: a new connection takes the request
            held = None
        if held is None:
            sock = None
            try:
                greeting_s = min(timeout_s, CONNECT_TIMEOUT_S)
                sock = connect(self.host, self.port, greeting_s)
                hello = self._greet(sock, time.monotonic() + greeting_s)
            except (OSError, FrameError) as err:
                if sock is not None:
                    sock.close()
                raise FrameRefused(f"{self.where}: {err}") from None
            held = self._local.conn = (sock, sock.makefile("rb"))
            self.open.add(sock)
            self._local.idle_s = float(hello.get("idle_timeout_s") or math.inf) / 2
            self._local.fresh_until = time.monotonic() + self._local.idle_s
        held[0].settimeout(timeout_s)
        return held

    def _greet(self, sock: socket.socket, deadline: float) -> dict:
        """The challenge-response (`transfer.frames`); the welcome, once the engine proved itself."""
        challenge = recv_frame_by(sock, HELLO_MAX_BYTES, deadline)
        theirs = None if challenge is None else challenge.get("challenge")
        if not isinstance(theirs, str):
            raise FrameError(f"the greeting was {challenge}, not a challenge")
        mine = new_challenge()
        send_frame(sock, {"challenge": mine, "proof": proof(self.api_key, CLIENT, theirs, mine)})
        hello = recv_frame_by(sock, HELLO_MAX_BYTES, deadline)
        if hello is None or hello.get("status") != 200 or hello.get("incarnation") != self.incarnation:
            # A wrong key goes over HTTP too, whose refusal says what to set.
            raise FrameError(f"the greeting was {hello}, not engine {self.incarnation}'s")
        if not proof_holds(self.api_key, SERVER, (mine, theirs, self.incarnation), hello.get("proof")):
            raise FrameError(f"the server greeting as engine {self.incarnation} did not prove it holds the "
                             "API key")
        return hello

    def close(self) -> None:
        """Close this thread's connection (others close with their threads or the process)."""
        held = getattr(self._local, "conn", None)
        self._local.conn = None
        if held is not None:
            self.open.discard(held[0])
            held[1].close()
            held[0].close()

    def post(self, route: str, body: dict[str, Any], timeout_s: float) -> tuple[int, Any]:
        """(status, reply body or error message) of one request; EngineUnreachable when no reply came."""
        sock, reader = self._connection(timeout_s)
        try:
            send_frame(sock, {"route": route, "body": body})
            reply = recv_frame(reader, MAX_REPLY_BYTES)
            if reply is None:
                raise ConnectionResetError("the engine closed the connection")
        except (OSError, FrameError) as err:
            self.close()
            if isinstance(err, TimeoutError):
                raise EngineHung(f"{self.where}: no answer within {timeout_s:g} s") from None
            raise EngineUnreachable(f"{self.where}: {err}") from None
        if reply.get("close"):  # the engine's last reply on this connection: the next request reconnects
            self.close()
        else:
            self._local.fresh_until = time.monotonic() + self._local.idle_s
        status = int(reply.get("status", 500))
        return status, reply.get("body") if status == 200 else reply.get("error", "")


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed a kept connection (or sent on it unasked): it cannot take a request."""
    try:
        sock.settimeout(0)  # with a timeout, Python waits out EAGAIN instead of raising it
        sock.recv(1, socket.MSG_PEEK)  # b"": closed; a byte: sent unasked
    except BlockingIOError:  # nothing to read: still open
        return False
    except OSError:
        pass
    return True
