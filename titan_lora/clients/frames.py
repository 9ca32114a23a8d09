"""The trainer's end of an engine's frame server (`transfer.frames`): one kept connection per thread.

`JsonClient` sends the routes of `protocol.FRAMED_ROUTES` through a `FrameChannel` once the engine's
INFO offered one. A request is never sent twice: a connection that breaks after its request went out
raises EngineUnreachable, since the engine may have acted on it (the syncer then checks the engine and
sends again as a whole).
"""

from __future__ import annotations

import socket
import threading
from typing import IO, Any

from titan_lora.transfer.errors import EngineUnreachable, TransferError
from titan_lora.transfer.frames import HELLO_MAX_BYTES, FrameError, connect, recv_frame, send_frame

MAX_REPLY_BYTES = 64 * 2**20


class FrameRefused(EngineUnreachable):
    """No frame connection could be made (nothing was sent): HTTP may still reach the engine."""


class FrameChannel:
    """Requests as frames to `host:port`, authenticated with `api_key`; `where` names it in errors."""

    def __init__(self, host: str, port: int, api_key: str, where: str) -> None:
        self.host, self.port = host, port
        self.api_key = api_key
        self.where = where
        self._local = threading.local()

    def _connection(self, timeout_s: float) -> tuple[socket.socket, IO[bytes]]:
        held = getattr(self._local, "conn", None)
        if held is None:
            try:
                sock = connect(self.host, self.port, timeout_s)
                reader = sock.makefile("rb")
                send_frame(sock, {"api_key": self.api_key})
                hello = recv_frame(reader, HELLO_MAX_BYTES)
            except (OSError, FrameError) as err:
                raise FrameRefused(f"{self.where}: {err}") from None
            if hello is None or hello.get("status") != 200:
                sock.close()
                if hello is not None and hello.get("status") == 401:
                    raise TransferError(f"{self.where} refused the API key (HTTP 401): set [engine] api_key "
                                        "to the key the engine was started with")
                raise FrameRefused(f"{self.where}: the engine closed the connection before greeting it")
            held = self._local.conn = (sock, reader)
        held[0].settimeout(timeout_s)
        return held

    def close(self) -> None:
        """Close this thread's connection (others close with their threads or the process)."""
        held = getattr(self._local, "conn", None)
        self._local.conn = None
        if held is not None:
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
            raise EngineUnreachable(f"{self.where}: {'timed out' if isinstance(err, TimeoutError) else err}") \
                from None
        status = int(reply.get("status", 500))
        return status, reply.get("body") if status == 200 else reply.get("error", "")

