"""A small JSON-over-HTTP client: keep-alive, an API key, a timeout, and errors that say what to do.

It uses `http.client` directly: one persistent connection per thread (a sync costs two requests, and
a new TCP connection plus a server thread per request costs milliseconds), no proxy and no redirects,
so a request and its API key go only to the address in the config.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import urllib.parse
from typing import Any

from titan_lora.transfer.errors import EngineUnreachable, LayoutUnknownToEngine, TransferError


class JsonClient:
    """POST JSON to `<base_url><path>` and return the decoded reply."""

    def __init__(self, base_url: str, api_key: str = "", timeout_s: float = 120.0) -> None:
        parsed = urllib.parse.urlsplit(base_url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"engine address {base_url!r} must look like http://host:port")
        self.base_url = base_url.rstrip("/")
        self._scheme, self._host = parsed.scheme, parsed.hostname
        self._port = parsed.port or (443 if parsed.scheme == "https" else 80)
        self.api_key = api_key
        self.timeout_s = timeout_s
        self._local = threading.local()

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
        conn.timeout = timeout_s
        if conn.sock is not None:
            conn.sock.settimeout(timeout_s)
        return conn

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        self._local.conn = None

    def post(self, path: str, body: dict[str, Any] | None = None, timeout_s: float | None = None) -> Any:
        """Send one request; raise EngineUnreachable, or TransferError with the engine's message."""
        data = json.dumps(body or {}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        for attempt in (0, 1):  # a kept-alive connection the server closed fails once: reconnect
            conn = self._connection(timeout_s or self.timeout_s)
            try:
                conn.request("POST", path, body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as err:
                self._drop_connection()
                if attempt == 1:
                    raise EngineUnreachable(f"{self.base_url}{path}: {err}") from None
            except (OSError, http.client.HTTPException) as err:
                self._drop_connection()
                raise EngineUnreachable(f"{self.base_url}{path}: {err}") from None
        if resp.status == 401:
            raise TransferError(
                f"{self.base_url} refused the API key (HTTP 401): set [engine] api_key to the "
                "key the engine was started with"
            )
        if resp.status == 409:
            raise LayoutUnknownToEngine(raw.decode(errors="replace"))
        if resp.status >= 300:
            raise TransferError(f"{self.base_url}{path} failed with HTTP {resp.status}: "
                               f"{raw.decode(errors='replace')[:2000]}")
        return json.loads(raw or b"null")
