"""The JSON-over-HTTP front of the receiver process (`engines/receiver.py`): POST /titan/<op> -> service op.
`answer` maps a route's outcome to a status for it and for the frame server (`engines/frame_server.py`).

A request is authenticated, and its Content-Length checked against a cap, before its body is read:
a caller without the key cannot make the engine read (or buffer) anything. Bodies must be JSON objects.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler

from titan_lora.transfer import protocol
from titan_lora.transfer.buckets import UnknownLayout

logger = logging.getLogger("titan_lora.engine")
DEFAULT_MAX_BODY_MB = 64


class _Refused(Exception):
    """A request answered with an error before its body was used."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def make_handler(routes: dict[str, Callable[[dict], dict]], api_key: str,
                 max_body_bytes: int = DEFAULT_MAX_BODY_MB * 2**20) -> type[BaseHTTPRequestHandler]:
    """An HTTP handler class that routes `/titan/<op>` to `routes[op](json_body)`."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: a sync is several requests on one connection
        disable_nagle_algorithm = True  # or delayed ACKs stall each small reply by ~40 ms

        def log_message(self, fmt: str, *args) -> None:  # noqa: ANN002
            logger.debug(fmt, *args)

        def _reply(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            self._serve(lambda: {})

        def do_POST(self) -> None:  # noqa: N802
            self._serve(self._read_body)

        def _serve(self, read: Callable[[], dict]) -> None:
            try:
                if api_key and self.headers.get("Authorization") != f"Bearer {api_key}":
                    raise _Refused(401, "missing or wrong API key (Authorization: Bearer ...)")
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
            except ValueError as err:
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
    except Exception as err:  # noqa: BLE001 (reported to the client; the server keeps serving)
        logger.exception("%s failed", op)
        return 500, {"error": f"{type(err).__name__}: {err}"}
