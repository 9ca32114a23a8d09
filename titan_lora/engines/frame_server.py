"""The receiver's frame server: the routes of `protocol.FRAMED_ROUTES` as framed JSON (`transfer.frames`).

One thread per connection, as the HTTP front has; a connection is authenticated by its first frame
(within `HELLO_TIMEOUT_S`) before any request is read, and a frame over the size cap is refused
before its body is read. The greeting names the engine's incarnation. The same `answer` as the HTTP
front maps each route's outcome to a status, so a request gets the same reply over either. A reply
after which the server closes the connection (a bad frame, a wrong key) says so (`"close": true`).
"""

from __future__ import annotations

import hmac
import logging
import socket
import socketserver
import threading
from collections.abc import Callable

from titan_lora.engines.http_server import answer
from titan_lora.transfer import protocol
from titan_lora.transfer.frames import HELLO_MAX_BYTES, FrameError, recv_frame, send_frame

logger = logging.getLogger("titan_lora.engine")
HELLO_TIMEOUT_S = 10.0


class FrameServer(socketserver.ThreadingTCPServer):
    """Serves `routes` (those of `protocol.FRAMED_ROUTES` among them) to clients that know `api_key`."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], routes: dict[str, Callable[[dict], dict]], api_key: str,
                 max_frame_bytes: int, incarnation: str) -> None:
        """`incarnation`: the engine's, as its INFO names it; the greeting echoes it, so that a client
        knows the port still belongs to the engine that offered it."""
        self.routes = {op: route for op, route in routes.items() if op in protocol.FRAMED_ROUTES}
        self.api_key = api_key
        self.max_frame_bytes = max_frame_bytes
        self.incarnation = incarnation
        super().__init__(address, _Connection)

    @property
    def port(self) -> int:
        """The port it listens on (the one INFO offers)."""
        return self.server_address[1]

    def start(self) -> threading.Thread:
        """Serve on a daemon thread (it ends with the process)."""
        thread = threading.Thread(target=self.serve_forever, name="titan-frames", daemon=True)
        thread.start()
        return thread


class _Connection(socketserver.StreamRequestHandler):
    server: FrameServer

    def handle(self) -> None:
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self.request.settimeout(HELLO_TIMEOUT_S)  # a peer that never greets does not hold a thread
            if not self._hello():
                return
            self.request.settimeout(None)  # a trainer's next request may come a training step later
            while (request := recv_frame(self.rfile, self.server.max_frame_bytes)) is not None:
                send_frame(self.request, self._reply(request))
        except FrameError as err:  # the stream cannot be trusted past a bad frame: answer, then close
            send_frame(self.request, {"status": err.status, "error": f"{err} (engine flag --max-body-mb)"
                                      if err.status == 413 else str(err), "close": True})
        except OSError as err:  # the trainer went away, or never greeted; a next connection starts afresh
            logger.debug("frame connection closed: %s", err)

    def _hello(self) -> bool:
        hello = recv_frame(self.rfile, HELLO_MAX_BYTES)
        if hello is None:
            return False
        key = self.server.api_key
        if key and not hmac.compare_digest(str(hello.get("api_key", "")).encode(), key.encode()):
            send_frame(self.request, {"status": 401, "error": "missing or wrong API key", "close": True})
            return False
        send_frame(self.request, {"status": 200, "incarnation": self.server.incarnation})
        return True

    def _reply(self, request: dict) -> dict:
        route, body = request.get("route"), request.get("body")
        if not isinstance(route, str):
            return {"status": 400, "error": f"a request's route must be a string, got {type(route).__name__}"}
        if not isinstance(body, dict):
            return {"status": 400, "error": f"a request's body must be a JSON object, got {type(body).__name__}"}
        status, reply = answer(self.server.routes, route, body, f"{protocol.PREFIX}{route}")
        return {"status": 200, "body": reply} if status == 200 else {"status": status, "error": reply["error"]}
