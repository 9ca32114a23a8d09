"""The receiver's frame server: the routes of `protocol.FRAMED_ROUTES` as framed JSON (`transfer.frames`).

One thread per connection, as the HTTP front has, at most `max_connections` at once (one over it is
answered 503 and closed at once). A connection must complete its greeting, a challenge-response in
which each side proves it holds the key without sending it, within `greeting_timeout_s` of being
accepted, however slowly its bytes come; only then is a request read, and a frame over the size cap
is refused before its body is read. A greeted connection idle for `idle_timeout_s` is closed (the
greeting tells the client, which reconnects before that). The greeting names the engine's
incarnation. The same `answer` as the HTTP front maps each route's outcome to a status, so a request
gets the same reply over either. A frame that cannot be decoded is answered 400; a reply after which
the server closes the connection (a bad frame, a wrong key) says so (`"close": true`).
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable

from titan_lora.engines.http_server import (
    DEFAULT_HEAD_TIMEOUT_S,
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    IO_TIMEOUT_S,
    CappedServer,
    answer,
)
from titan_lora.transfer import protocol
from titan_lora.transfer.frames import (
    CLIENT,
    HELLO_MAX_BYTES,
    SERVER,
    FrameError,
    encode_frame,
    new_challenge,
    proof,
    proof_holds,
    recv_frame,
    recv_frame_by,
    send_frame,
)

logger = logging.getLogger("titan_lora.engine")


class FrameServer(CappedServer, socketserver.TCPServer):
    """Serves `routes` (those of `protocol.FRAMED_ROUTES` among them) to clients that prove they know
    `api_key` (anyone, when it is empty)."""

    def __init__(self, address: tuple[str, int], routes: dict[str, Callable[[dict], dict]], api_key: str,
                 max_frame_bytes: int, incarnation: str, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 greeting_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S,
                 idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S) -> None:
        """`incarnation`: the engine's, as its INFO names it; the greeting echoes it, so that a client
        knows the port still belongs to the engine that offered it."""
        self.routes = {op: route for op, route in routes.items() if op in protocol.FRAMED_ROUTES}
        self.api_key = api_key
        self.max_frame_bytes = max_frame_bytes
        self.incarnation = incarnation
        self.greeting_timeout_s = greeting_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.init_cap(max_connections)
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

    def refusal(self) -> bytes:
        """A 503 frame, the connection's last."""
        error = (f"the engine serves {self.max_connections} frame connections already (engine flag "
                 "--max-connections)")
        return encode_frame({"status": 503, "error": error, "close": True})


class _Connection(socketserver.StreamRequestHandler):
    server: FrameServer

    def handle(self) -> None:
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            if not self._greet(time.monotonic() + self.server.greeting_timeout_s):
                return
            # A trainer's next request may come a training step later: the client reconnects before this.
            self.request.settimeout(self.server.idle_timeout_s)
            while (request := recv_frame(self.rfile, self.server.max_frame_bytes)) is not None:
                send_frame(self.request, self._reply(request))
        except FrameError as err:  # the stream cannot be trusted past a bad frame: answer, then close
            self._last({"status": err.status, "error": f"{err} (engine flag --max-body-mb)"
                        if err.status == 413 else str(err), "close": True})
        except OSError as err:  # gone, timed out (greeting deadline, idle) or shut down at exit
            logger.debug("frame connection closed: %s", err)

    def _last(self, message: dict) -> None:
        try:
            self.request.settimeout(IO_TIMEOUT_S)
            send_frame(self.request, message)
        except OSError:  # a peer that does not read loses the reply, not the thread
            pass

    def _greet(self, deadline: float) -> bool:
        """The challenge-response (`transfer.frames`), all of it by `deadline`; False: not greeted."""
        challenge = new_challenge()
        self.request.settimeout(max(deadline - time.monotonic(), 0.001))
        send_frame(self.request, {"challenge": challenge})
        hello = recv_frame_by(self.request, HELLO_MAX_BYTES, deadline)
        if hello is None:
            return False
        theirs, key = hello.get("challenge"), self.server.api_key
        if not isinstance(theirs, str) or (key and not proof_holds(key, CLIENT, (challenge, theirs),
                                                                     hello.get("proof"))):
            self._last({"status": 401, "error": "missing or wrong API key", "close": True})
            return False
        incarnation = self.server.incarnation
        send_frame(self.request, {"status": 200, "incarnation": incarnation,
                                  "idle_timeout_s": self.server.idle_timeout_s,
                                  "proof": proof(key, SERVER, theirs, challenge, incarnation)})
        return True

    def _reply(self, request: dict) -> dict:
        route, body = request.get("route"), request.get("body")
        if not isinstance(route, str):
            return {"status": 400, "error": f"a request's route must be a string, got {type(route).__name__}"}
        if not isinstance(body, dict):
            return {"status": 400, "error": f"a request's body must be a JSON object, got {type(body).__name__}"}
        status, reply = answer(self.server.routes, route, body, f"{protocol.PREFIX}{route}")
        return {"status": 200, "body": reply} if status == 200 else {"status": status, "error": reply["error"]}
