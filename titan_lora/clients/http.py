"""A small JSON-over-HTTP client: keep-alive, an API key, a timeout, and errors that say what to do.

It uses `http.client` directly: one persistent connection per thread (a sync costs two requests, and
a new TCP connection plus a server thread per request costs milliseconds), no proxy and no redirects,
so a request and its API key go only to the address in the config. Where the engine's INFO reply
offers frames (`transfer.frames`) on a plain `http://` address, the routes of `protocol.FRAMED_ROUTES`
go as frames to the same host (`clients.frames`), with the same replies and errors; a frames port that
cannot be reached or greeted is not tried again for that engine incarnation, and the request goes
over HTTP.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import urllib.parse
from collections.abc import Callable
from typing import Any

from titan_lora.clients.frames import FrameChannel, FrameRefused
from titan_lora.clients.sockets import OpenSockets
from titan_lora.transfer import protocol
from titan_lora.transfer.errors import EngineHung, EngineUnreachable, LayoutUnknownToEngine, TransferError
from titan_lora.transfer.frames import FRAMES_PORT

logger = logging.getLogger(__name__)
LIVE_ENGINE_SHARE = 0.8
"""LIVE asks the engine to answer within this share of the check's timeout (504 past it), so that its answer
comes before the socket's timeout, which catches a front that is itself frozen (a SIGSTOPped server)."""


class HTTPStatusError(TransferError):
    """The engine answered with an error status (`status`)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class ApiKey:
    """An engine's API key as it is now: an attached engine's stays; an embedded engine's launcher sets a
    fresh one at every start (`EmbeddedEngine`), so a key a dead engine's port took is of no use to
    the next incarnation. Clients read `value` for each request."""

    def __init__(self, value: str = "") -> None:
        self.value = value


class JsonClient:
    """POST JSON to `<base_url><path>` and return the decoded reply; `api_key` is read per request."""

    def __init__(self, base_url: str, api_key: str | ApiKey = "", timeout_s: float = 120.0) -> None:
        parsed = urllib.parse.urlsplit(base_url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"engine address {base_url!r} must look like http://host:port")
        self.base_url = base_url.rstrip("/")
        self._scheme, self._host = parsed.scheme, parsed.hostname
        self._port = parsed.port or (443 if parsed.scheme == "https" else 80)
        self._key = api_key if isinstance(api_key, ApiKey) else ApiKey(api_key)
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._frames: FrameChannel | None = None  # the channel the last INFO reply offered
        self._refused: set[tuple[str, int]] = set()  # (incarnation, frames port) not reached: HTTP instead
        self._open = OpenSockets()  # every thread's connection: `interrupt` ends their requests
        self._interrupt_reason = ""

    @property
    def api_key(self) -> str:
        """The key requests carry now."""
        return self._key.value

    def _connection(self, timeout_s: float) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
            conn = cls(self._host, self._port, timeout=timeout_s)
            try:
                conn.connect()
            except OSError as err:
                raise EngineUnreachable(f"{self.base_url}: {err}") from None
            # Headers and body go in separate writes: without NODELAY, Nagle + delayed ACK add ~40 ms.
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._local.conn = conn
            self._open.add(conn.sock)
        conn.timeout = timeout_s
        if conn.sock is not None:
            conn.sock.settimeout(timeout_s)
        return conn

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            self._open.discard(conn.sock)
            conn.close()
        self._local.conn = None

    def interrupt(self, reason: str) -> None:
        """End every request in flight on this client, from any thread, at once: each raises EngineHung
        with `reason` instead of waiting out its timeout (the engine was found wedged). Later requests
        connect afresh."""
        self._interrupt_reason = reason
        frames = self._frames
        if frames is not None:
            frames.open.wake_all()
        self._open.wake_all()

    def check_live(self, timeout_s: float) -> None:
        """Raise EngineHung unless the engine's LIVE route (a no-op through its engine core and workers)
        answers within `timeout_s`, its front included (a CPU engine computing one long step answers busy,
        which is live); EngineUnreachable when nothing listens."""
        try:
            reply = self.post(protocol.path(protocol.LIVE), {"timeout_s": timeout_s * LIVE_ENGINE_SHARE},
                              timeout_s=timeout_s)
            if reply.get("busy_s"):  # live, one long step in progress (a CPU engine computing: not a wedge)
                logger.info("%s: one engine step has outlasted LIVE's %.1f s bound, its processes computing "
                            "meanwhile (CPU demand / wait: %s): busy, not wedged", self.base_url,
                            reply["busy_s"], reply.get("cpu_shares"))
        except HTTPStatusError as err:
            if err.status == 401:
                raise
            if err.status == 404:  # an engine from before LIVE: INFO answering is all it can show
                logger.warning("%s serves no %s route: a wedged engine core cannot be told from a live "
                               "one (update titan_lora on the engine)", self.base_url,
                               protocol.path(protocol.LIVE))
                self.post(protocol.path(protocol.INFO), timeout_s=timeout_s)
                return
            raise EngineHung(f"{self.base_url}: its API server answers, but the engine behind it does not: "
                             f"{err}") from None

    def _interrupted_since(self, seen: int) -> bool:
        return self._open.wakes != seen

    def post(self, path: str, body: dict[str, Any] | None = None, timeout_s: float | None = None) -> Any:
        """Send one request; raise EngineUnreachable (EngineHung: no answer in time, or interrupted), or
        TransferError with the engine's message."""
        seen = self._open.wakes
        try:
            return self._post(path, body, timeout_s)
        except EngineUnreachable as err:
            if self._interrupted_since(seen):
                raise EngineHung(f"{self.base_url}{path}: abandoned: {self._interrupt_reason}") from None
            raise err from None

    def _post(self, path: str, body: dict[str, Any] | None, timeout_s: float | None) -> Any:
        frames, route = self._frames, protocol.route_of(path)
        if frames is not None and route in protocol.FRAMED_ROUTES:
            try:  # EngineUnreachable passes: the request may have been acted on, so it is not resent
                status, reply = frames.post(route, body or {}, timeout_s or self.timeout_s)
            except FrameRefused as err:  # nothing was sent
                logger.warning("%s; sending over HTTP instead", err)
                self._refused.add((frames.incarnation, frames.port))
                if self._frames is frames:  # not one that another thread's INFO installed meanwhile
                    self._frames = None
            else:
                _raise_for_status(self.base_url, f"{self.base_url}{path} (frames)", status,
                                  lambda: json.dumps({"error": reply}))
                return reply
        reply = self._http_post(path, body, timeout_s)
        if route == protocol.INFO and isinstance(reply, dict):
            self._follow_offer(reply)
        return reply

    def _follow_offer(self, info: dict) -> None:
        """Use the frames port an INFO reply names, of the incarnation it names; HTTP where it names none,
        where that port could not be reached, and for an https address (frames are plain TCP)."""
        port, incarnation = info.get(FRAMES_PORT), info.get("incarnation")
        if self._scheme != "http" or not isinstance(port, int) or not isinstance(incarnation, str) \
                or (incarnation, port) in self._refused:
            self._frames = None
        elif self._frames is None or (self._frames.port, self._frames.incarnation) != (port, incarnation):
            self._frames = FrameChannel(self._host, port, self.api_key, incarnation,
                                        f"{self.base_url} (frames port {port})")

    def _http_post(self, path: str, body: dict[str, Any] | None, timeout_s: float | None) -> Any:
        data = json.dumps(body or {}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        seen = self._open.wakes
        for attempt in (0, 1):  # a kept-alive connection the server closed fails once: reconnect
            conn = self._connection(timeout_s or self.timeout_s)
            try:
                conn.request("POST", path, body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
                break
            except TimeoutError:
                self._drop_connection()
                raise EngineHung(f"{self.base_url}{path}: no answer within "
                                 f"{timeout_s or self.timeout_s:g} s") from None
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as err:
                self._drop_connection()
                if attempt == 1 or self._interrupted_since(seen):  # never resend an interrupted request
                    raise EngineUnreachable(f"{self.base_url}{path}: {err}") from None
            except (OSError, http.client.HTTPException) as err:
                self._drop_connection()
                raise EngineUnreachable(f"{self.base_url}{path}: {err}") from None
        _raise_for_status(self.base_url, f"{self.base_url}{path}", resp.status,
                          lambda: raw.decode(errors="replace"))
        return json.loads(raw or b"null")


def _raise_for_status(base_url: str, where: str, status: int, answer: Callable[[], str]) -> None:
    """Nothing for a success `status`; else the error that says what to do (`answer`: the engine's text,
    made only for an error)."""
    if status < 300:
        return
    text = answer()
    if status == 401:
        raise HTTPStatusError(f"{base_url} refused the API key (HTTP 401): set [engine] api_key to the key "
                              "the engine was started with", status)
    if status == 409:
        raise LayoutUnknownToEngine(text)
    raise HTTPStatusError(f"{where} failed with HTTP {status}: {text[:2000]}", status)
