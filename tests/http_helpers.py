"""Local HTTP servers for client tests: answer a handler's request with JSON, and serve for a test's length."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def answer_json(handler: BaseHTTPRequestHandler, reply: dict, status: int = 200) -> None:
    """Send `reply` as the JSON body of a `status` response."""
    data = json.dumps(reply).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def completion_of(body: dict) -> dict:
    """vLLM's `/v1/completions` reply to `body`: `n` choices of one token, 7, at log-prob -0.5."""
    choices = [{"index": i, "text": "7", "token_ids": [7], "finish_reason": "length",
                "logprobs": {"token_logprobs": [-0.5], "tokens": ["7"], "top_logprobs": None, "text_offset": [0]}}
               for i in range(body.get("n", 1))]
    return {"id": "c", "object": "text_completion", "created": 0, "model": body["model"], "choices": choices}


@contextlib.contextmanager
def serving(srv: ThreadingHTTPServer, release: Callable[[], None] = lambda: None) -> Iterator[ThreadingHTTPServer]:
    """`srv` served on a daemon thread until the block ends; then `release` (e.g. unblock stalled handlers)
    runs before the server shuts down."""
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield srv
    finally:
        release()
        srv.shutdown()
        srv.server_close()
