"""Futures the SDK polls: every training call is answered at once with a request id, and its result is fetched
through `/retrieve_future`, which the service holds open until the result is ready (or answers "try again"
before the client's 45 s poll timeout, never instantly: the SDK re-polls with no pause).

Results are set from the worker thread and awaited on the HTTP server's event loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass

RESULT_TTL_S = 600.0
"""How long a finished result is kept for its poller (the SDK polls at once; a lost poll is retried in seconds)."""


@dataclass
class Result:
    """A finished request: a JSON answer, a protobuf answer (`proto`), or a failure (`error`, `category`)."""

    json: dict | None = None
    proto: bytes | None = None
    error: str | None = None
    category: str = "user"


class FutureStore:
    """Request id -> its pending or finished result, per API key (a key polls only its own ids)."""

    def __init__(self, ttl_s: float = RESULT_TTL_S) -> None:
        self._lock = threading.Lock()
        self._owner: dict[str, str] = {}
        self._results: dict[str, Result] = {}
        self._finished: dict[str, float] = {}  # request id -> when, in finishing order
        self._ttl_s = ttl_s
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}

    def new(self, key: str) -> str:
        """A fresh request id owned by `key`."""
        request_id = uuid.uuid4().hex
        with self._lock:
            self._owner[request_id] = key
        return request_id

    def owned(self, request_id: str, key: str) -> bool:
        """Whether `request_id` exists and belongs to `key`."""
        with self._lock:
            return self._owner.get(request_id) == key

    def pending(self, key: str) -> int:
        """How many of `key`'s requests have no result yet."""
        with self._lock:
            return sum(1 for r, k in self._owner.items() if k == key and r not in self._results)

    def finish(self, request_id: str, result: Result) -> None:
        """Set a request's result (any thread) and wake its pollers."""
        with self._lock:
            self._results[request_id] = result
            now = time.monotonic()
            self._finished[request_id] = now
            for old, when in list(self._finished.items()):  # oldest first: stop at the first one kept
                if now - when < self._ttl_s:
                    break
                del self._finished[old], self._results[old], self._owner[old]
            waiters = self._waiters.pop(request_id, [])
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    async def wait(self, request_id: str, timeout_s: float) -> Result | None:
        """The result, waiting up to `timeout_s` for it (None: still pending). A result stays `RESULT_TTL_S`
        after it finished: a poll lost on the network is answered again."""
        with self._lock:
            if request_id in self._results:
                return self._results[request_id]
            event = asyncio.Event()
            self._waiters.setdefault(request_id, []).append((asyncio.get_running_loop(), event))
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except asyncio.TimeoutError:
            return None
        with self._lock:
            return self._results.get(request_id)
