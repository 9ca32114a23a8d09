"""The JSON-over-HTTP front of the receiver process (`engines/receiver.py`): POST /titan/<op> -> service op.
`answer` maps a route's outcome to a status for it and for the frame server (`engines/frame_server.py`).

A caller without the key holds little and not for long: a request's line and headers must come
within `head_timeout_s` of its first byte and within `MAX_HEAD_BYTES` (431 past it), a kept
connection idle for `idle_timeout_s` is closed, and at most `max_connections` are served at once
(`CappedServer`: one over it is answered 503 and closed at once). The request is then authenticated,
and its Content-Length checked against a cap, before its body is read. Bodies must be JSON objects.
"""

from __future__ import annotations

import hmac
import http.client
import io
import json
import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from titan_lora.transfer import protocol
from titan_lora.transfer.buckets import UnknownLayout

logger = logging.getLogger("titan_lora.engine")
DEFAULT_MAX_BODY_MB = 64
DEFAULT_MAX_CONNECTIONS = 64
"""Per front: a trainer keeps one connection per thread that posts (a few), and health checks one more."""
DEFAULT_HEAD_TIMEOUT_S = 10.0
"""From a request's first byte to the end of its headers (HTTP), or to the end of a greeting (frames)."""
DEFAULT_IDLE_TIMEOUT_S = 300.0
"""A kept connection with no request for this long is closed (the trainer's client reconnects)."""
MAX_HEAD_BYTES = 16 * 2**10
"""A request line and headers over this are refused (431): the trainer's are a few hundred bytes."""
IO_TIMEOUT_S = 60.0
"""Per read of an authenticated body, and per write of a reply."""


class CappedServer(socketserver.ThreadingMixIn):
    """A threading server's mixin: at most `max_connections` served at once, one over it refused at
    once (`refuse`), and every live one closable (`close_connections`). Call `init_cap` first."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # socketserver's 5 drops a burst's SYNs: each retried a second later

    def init_cap(self, max_connections: int) -> None:
        """Serve at most `max_connections` at once."""
        self.max_connections = max_connections
        self._live: dict[socket.socket, threading.Thread] = {}
        self._live_lock = threading.Lock()
        self._closing = False

    def process_request(self, request: socket.socket, client_address: tuple) -> None:
        with self._live_lock:
            admitted = not self._closing and len(self._live) < self.max_connections
            if admitted:  # started under the lock: `close_connections` never joins an unstarted thread
                thread = threading.Thread(target=self.process_request_thread, args=(request, client_address),
                                          name="titan-front-conn", daemon=True)
                self._live[request] = thread
                thread.start()
        if not admitted:
            try:  # never blocks the accept loop: a peer that does not read loses the reply
                request.setblocking(False)
                request.send(self.refusal())
            except OSError:
                pass
            self.shutdown_request(request)

    def process_request_thread(self, request: socket.socket, client_address: tuple) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._live_lock:
                self._live.pop(request, None)

    def refusal(self) -> bytes:
        """What a connection over the cap is sent before it is closed."""
        raise NotImplementedError

    def live_connections(self) -> int:
        """How many connections are being served now."""
        with self._live_lock:
            return len(self._live)

    def close_connections(self, timeout_s: float) -> int:
        """Admit no more connections, shut every live one down (its next read ends) and wait up to
        `timeout_s` for their threads (a route in progress finishes first); returns how many were live."""
        with self._live_lock:
            self._closing = True
            live = dict(self._live)
        for sock in live:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for thread in live.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        return len(live)


class FrontServer(CappedServer, ThreadingHTTPServer):
    """The receiver's HTTP server, capped (`CappedServer`)."""

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
        self.init_cap(max_connections)
        super().__init__(address, handler)

    def refusal(self) -> bytes:
        """503, JSON, and the connection's end."""
        body = json.dumps({"error": f"the engine serves {self.max_connections} connections already "
                                    "(engine flag --max-connections)"}).encode()
        return (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


class _Deadlines(io.RawIOBase):
    """A socket's reads, each given what is left of the phase it is in: a request's line and headers
    (`head_s` from the connection's start, or from their first byte on a kept connection, which may
    wait `idle_s` for it), or its body (`IO_TIMEOUT_S` per read, once the request is authenticated)."""

    def __init__(self, sock: socket.socket, idle_s: float, head_s: float) -> None:
        self.sock, self.idle_s, self.head_s = sock, idle_s, head_s
        self.head = True
        self.deadline: float | None = None
        self.served = False

    def readable(self) -> bool:
        return True

    def await_request(self) -> None:
        """The next bytes start a request; a new connection's first must be all in within `head_s`."""
        self.head = True
        self.deadline = None if self.served else time.monotonic() + self.head_s
        self.served = True

    def read_body(self) -> None:
        """The headers are in and the caller authenticated: each read of the body gets `IO_TIMEOUT_S`."""
        self.head, self.deadline = False, None

    def readinto(self, buffer: memoryview) -> int:
        if not self.head:
            timeout = IO_TIMEOUT_S
        elif self.deadline is None:
            timeout = self.idle_s
        else:
            timeout = self.deadline - time.monotonic()
            if timeout <= 0:
                raise TimeoutError(f"a request's line and headers took over {self.head_s:g} s")
        self.sock.settimeout(timeout)
        n = self.sock.recv_into(buffer)
        if n and self.head and self.deadline is None:
            self.deadline = time.monotonic() + self.head_s
        return n


class _Requests(io.BufferedReader):
    """The buffered reader of a connection; while a request's head is read, its lines together are
    held to `MAX_HEAD_BYTES` (past it: LineTooLong, whose 431 the handler sends)."""

    head_left: int | None = None

    def readline(self, limit: int | None = -1) -> bytes:
        if self.head_left is None:
            return super().readline(limit)
        cap = self.head_left + 1
        line = super().readline(cap if limit is None or limit < 0 else min(limit, cap))
        self.head_left -= len(line)
        if self.head_left < 0:
            raise http.client.LineTooLong(f"request line and headers over {MAX_HEAD_BYTES} bytes")
        return line


class _Refused(Exception):
    """A request answered with an error before its body was used."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def make_handler(routes: dict[str, Callable[[dict], dict]], api_key: str,
                 max_body_bytes: int = DEFAULT_MAX_BODY_MB * 2**20, head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S,
                 idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S) -> type[BaseHTTPRequestHandler]:
    """An HTTP handler class that routes `/titan/<op>` to `routes[op](json_body)`."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: a sync is several requests on one connection
        disable_nagle_algorithm = True  # or delayed ACKs stall each small reply by ~40 ms

        def setup(self) -> None:
            super().setup()
            self.rfile.close()  # replaced by one whose reads keep the deadlines
            self._deadlines = _Deadlines(self.connection, idle_timeout_s, head_timeout_s)
            self.rfile = _Requests(self._deadlines)

        def handle_one_request(self) -> None:
            self._deadlines.await_request()
            self.rfile.head_left = MAX_HEAD_BYTES
            try:
                super().handle_one_request()  # headers over the cap: parse_request answers 431 itself
            except http.client.LineTooLong as err:  # the request line alone was over it
                self.requestline, self.request_version, self.command = "", "HTTP/1.1", ""
                self.close_connection = True
                self._reply(431, {"error": str(err)})
            except OSError as err:  # reset by the peer, or shut down by `close_connections`
                logger.debug("HTTP connection closed: %s", err)
                self.close_connection = True

        def log_message(self, fmt: str, *args) -> None:  # noqa: ANN002
            logger.debug(fmt, *args)

        def _reply(self, code: int, body: dict) -> None:
            self.connection.settimeout(IO_TIMEOUT_S)
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._serve(lambda: {})

        def do_POST(self) -> None:
            self._serve(self._read_body)

        def _serve(self, read: Callable[[], dict]) -> None:
            self.rfile.head_left = None
            try:
                if api_key and not hmac.compare_digest(self.headers.get("Authorization", "").encode(),
                                                       f"Bearer {api_key}".encode()):
                    raise _Refused(401, "missing or wrong API key (Authorization: Bearer ...)")
                self._deadlines.read_body()
                body = read()
            except _Refused as err:
                # The body (if any) stays unread: the connection cannot carry another request.
                self.close_connection = True
                return self._reply(err.code, {"error": str(err)})
            self._handle(body)

        def _read_body(self) -> dict:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                raise _Refused(400, "Content-Length is not a number") from None
            if length < 0 or length > max_body_bytes:
                raise _Refused(413, f"request body of {length} bytes is over the engine's limit of "
                                    f"{max_body_bytes} bytes (engine flag --max-body-mb)")
            if length and self.headers.get_content_type() != "application/json":
                raise _Refused(415, "the body must be JSON (Content-Type: application/json)")
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
            except (ValueError, RecursionError) as err:  # RecursionError: arrays nested thousands deep
                raise _Refused(400, f"the body is not valid JSON: {err}") from None
            if not isinstance(body, dict):
                raise _Refused(400, f"the body must be a JSON object, got {type(body).__name__}")
            return body

        def _handle(self, body: dict) -> None:
            self._reply(*answer(routes, protocol.route_of(self.path), body, self.path))

    return Handler


def answer(routes: dict[str, Callable[[dict], dict]], op: str | None, body: dict, where: str) -> tuple[int, dict]:
    """(HTTP status, reply) of route `op` on `body`: what the HTTP front and the frame server both answer
    (`where`: the request's path, for a 404)."""
    if op not in routes:
        return 404, {"error": f"unknown route {where}"}
    try:
        return 200, routes[op](body)
    except UnknownLayout as err:
        return 409, {"error": f"UnknownLayout: {err}"}
    except TimeoutError as err:
        return 504, {"error": f"TimeoutError: {err}"}
    except (KeyError, ValueError) as err:
        return 400, {"error": f"{type(err).__name__}: {err}"}
    except Exception as err:  # reported to the client; the server keeps serving
        logger.exception("%s failed", op)
        return 500, {"error": f"{type(err).__name__}: {err}"}
