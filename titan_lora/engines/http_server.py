"""The JSON-over-HTTP front shared by the engine processes: POST /titan/<op> -> service op."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler

from titan_lora.emitters.buckets import UnknownLayout

logger = logging.getLogger("titan_lora.engine")


def make_handler(routes: dict[str, Callable[[dict], dict]], api_key: str) -> type[BaseHTTPRequestHandler]:
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
            self._handle({})

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length", 0))
            self._handle(json.loads(self.rfile.read(length) or b"{}"))

        def _handle(self, body: dict) -> None:
            if api_key and self.headers.get("Authorization") != f"Bearer {api_key}":
                return self._reply(401, {"error": "missing or wrong API key (Authorization: Bearer ...)"})
            op = self.path.removeprefix("/titan/")
            if op not in routes:
                return self._reply(404, {"error": f"unknown route {self.path}"})
            try:
                self._reply(200, routes[op](body))
            except UnknownLayout as err:
                self._reply(409, {"error": f"UnknownLayout: {err}"})
            except (KeyError, ValueError) as err:
                self._reply(400, {"error": f"{type(err).__name__}: {err}"})
            except Exception as err:  # noqa: BLE001 (reported to the client; the server keeps serving)
                logger.exception("%s failed", op)
                self._reply(500, {"error": f"{type(err).__name__}: {err}"})

    return Handler
