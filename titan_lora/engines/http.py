"""A small JSON-over-HTTP client with an API key, a timeout and errors that say what to do."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from titan_lora.emitters.base import EmitterError


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        return None  # a redirect would send the body and the API key to a host the config did not name


# No proxy and no redirects: requests go only to the address in the config.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


class EngineUnreachable(EmitterError):
    """The engine did not answer (not started, restarting, or a wrong address)."""


class JsonClient:
    """POST JSON to `<base_url><path>` and return the decoded reply."""

    def __init__(self, base_url: str, api_key: str = "", timeout_s: float = 120.0) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"engine address {base_url!r} must start with http:// or https://")
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s

    def post(self, path: str, body: dict[str, Any] | None = None, timeout_s: float | None = None) -> Any:
        """Send one request; raise EngineUnreachable, or EmitterError with the engine's message."""
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with _OPENER.open(req, timeout=timeout_s or self.timeout_s) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:2000]
            if err.code == 401:
                raise EmitterError(
                    f"{self.base_url} refused the API key (HTTP 401): set [weight_sync] api_key to the "
                    "key the engine was started with"
                ) from None
            raise EmitterError(f"{self.base_url}{path} failed with HTTP {err.code}: {detail}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as err:
            raise EngineUnreachable(f"{self.base_url}{path}: {getattr(err, 'reason', err)}") from None
