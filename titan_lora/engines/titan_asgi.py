"""titan_lora's part of vLLM's OpenAI server, as the ASGI middleware vLLM's `--middleware` adds.

- `/titan/<route>`: the transfer routes (`openai_service.TitanService`), behind the server's API key
  (vLLM's own check guards only `/v1` and a few other prefixes). A request is authenticated, and its
  Content-Length checked against a cap, before its body is read.
- every JSON POST under `/v1/` that names a model: the bare adapter name (the alias) becomes the
  versioned name of the newest version, resolved now, and the request holds a lease on the version it
  runs on until its response (streamed or not) is over; a version that is no longer live gets a 404
  that says which ones are. Names that are not ours go to vLLM untouched.
- a chat completion that names an episode (`protocol.EPISODE_HEADER`) is a turn of it, pinned to the
  episode's version and recorded token by token (`episode_capture`).
- at shutdown (SIGTERM, SIGINT), before vLLM stops its engine, every worker unmaps the trainer's buffers
  (`vllm_compat.run_before_shutdown`: vLLM stops the engine before the ASGI lifespan ends).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from titan_lora.engines import episode_capture
from titan_lora.engines import vllm_compat as compat
from titan_lora.engines.episode_log import Pin
from titan_lora.engines.openai_service import TitanService
from titan_lora.transfer import protocol
from titan_lora.transfer.buckets import UnknownLayout
from titan_lora.transfer.episodes import UnknownEpisode

logger = logging.getLogger("titan_lora.engine")
MAX_BODY_BYTES = 64 * 2**20
RELEASE_TIMEOUT_S = 20.0  # below the 30 s a launcher waits after SIGTERM before it kills
ROUTES = (*protocol.TRANSFER_ROUTES, *protocol.VERIFY_ROUTES, protocol.ADAPTER_FROM_PATH,
          *protocol.EPISODE_ROUTES)


def _error(code: int, message: str, err_type: str = "BadRequestError", param: str | None = None) -> JSONResponse:
    """An error in the shape vLLM's OpenAI server answers with (the openai client reads it)."""
    return JSONResponse({"error": {"message": message, "type": err_type, "param": param, "code": code}},
                        status_code=code)


class _Refused(Exception):
    """A request answered with an error before its body was used."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


async def _read_body(receive: Any, limit: int | None = None) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Refused(400, "the client disconnected before sending its body")
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if limit is not None and size > limit:
            raise _Refused(413, f"request body over the engine's limit of {limit} bytes")
        if not message.get("more_body"):
            return b"".join(chunks)


def _replay(body: bytes, receive: Any) -> Any:
    """A `receive` that hands out `body` once, then whatever the client sends next (a disconnect)."""
    sent = False

    async def replayed() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


class TitanRoutes:
    """ASGI middleware: the `/titan/*` routes, adapter aliases and leases, release at shutdown."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._service: TitanService | None = None
        self._starting = asyncio.Lock()
        self._tokens: list[bytes] | None = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        route = protocol.route_of(path)
        if route is not None:
            return await self._titan(route, scope, receive, send)
        if scope.get("method") == "POST" and path.startswith("/v1/") and self._authorized(scope):
            return await self._leased(scope, receive, send)
        return await self.app(scope, receive, send)

    # ---- state ---------------------------------------------------------------------------------------
    async def _get_service(self, scope: dict) -> TitanService:
        if self._service is None:
            async with self._starting:
                if self._service is None:
                    state = scope["app"].state
                    self._service = await TitanService.start(
                        state.engine_client, state.openai_serving_models, state.args.model)
                    compat.run_before_shutdown(state.engine_client, self._release, RELEASE_TIMEOUT_S + 5)
        return self._service

    def _authorized(self, scope: dict) -> bool:
        if self._tokens is None:
            self._tokens = [hashlib.sha256(k.encode()).digest() for k in compat.api_keys(scope["app"].state.args)]
        if not self._tokens:
            return True
        scheme, _, given = (Headers(scope=scope).get("Authorization") or "").partition(" ")
        digest = hashlib.sha256(given.encode()).digest()
        return scheme.lower() == "bearer" and any(secrets.compare_digest(digest, t) for t in self._tokens)

    # ---- /titan/* ------------------------------------------------------------------------------------
    async def _titan(self, route: str, scope: dict, receive: Any, send: Any) -> None:
        try:
            if not self._authorized(scope):
                raise _Refused(401, "missing or wrong API key (Authorization: Bearer ...)")
            if route not in ROUTES:
                raise _Refused(404, f"unknown route {scope['path']}")
            body = await self._titan_body(scope, receive)
        except _Refused as err:
            return await JSONResponse({"error": str(err)}, status_code=err.code)(scope, receive, send)
        response = await self._dispatch(route, scope, body)
        await response(scope, receive, send)

    async def _titan_body(self, scope: dict, receive: Any) -> dict:
        if scope["method"] == "GET":
            return {}
        headers = Headers(scope=scope)
        try:
            length = int(headers.get("content-length") or 0)
        except ValueError:
            raise _Refused(400, "Content-Length is not a number") from None
        if length < 0 or length > MAX_BODY_BYTES:
            raise _Refused(413, f"request body of {length} bytes is over the engine's limit of "
                                f"{MAX_BODY_BYTES} bytes")
        if length and headers.get("content-type", "").split(";")[0].strip() != "application/json":
            raise _Refused(415, "the body must be JSON (Content-Type: application/json)")
        try:
            body = json.loads(await _read_body(receive, MAX_BODY_BYTES) or b"{}")
        except ValueError as err:
            raise _Refused(400, f"the body is not valid JSON: {err}") from None
        if not isinstance(body, dict):
            raise _Refused(400, f"the body must be a JSON object, got {type(body).__name__}")
        return body

    async def _dispatch(self, route: str, scope: dict, body: dict) -> JSONResponse:
        try:
            service = await self._get_service(scope)
            return JSONResponse(await getattr(service, route)(body))
        except UnknownLayout as err:
            return JSONResponse({"error": f"UnknownLayout: {err}"}, status_code=409)
        except UnknownEpisode as err:
            return JSONResponse({"error": f"UnknownEpisode: {err}"}, status_code=404)
        except TimeoutError as err:
            return JSONResponse({"error": f"TimeoutError: {err}"}, status_code=504)
        except (KeyError, ValueError) as err:
            return JSONResponse({"error": f"{type(err).__name__}: {err}"}, status_code=400)
        except Exception as err:  # reported to the client; the server keeps serving
            logger.exception("/titan/%s failed", route)
            return JSONResponse({"error": f"{type(err).__name__}: {err}"}, status_code=500)

    # ---- /v1/*: aliases and leases -------------------------------------------------------------------
    async def _leased(self, scope: dict, receive: Any, send: Any) -> None:
        if Headers(scope=scope).get("content-type", "").split(";")[0].strip() != "application/json":
            return await self.app(scope, receive, send)
        try:
            raw = await _read_body(receive)
        except _Refused:
            return  # the client is gone
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        model = body.get("model") if isinstance(body, dict) else None
        try:
            episode = episode_capture.episode_of(scope)
            if episode is not None and not isinstance(model, str):
                raise episode_capture.EpisodeRefused(
                    400, "a turn of an episode is a JSON object that names its model")
        except episode_capture.EpisodeRefused as err:
            return await _error(err.code, str(err))(scope, receive, send)
        if not isinstance(model, str):
            return await self.app(scope, _replay(raw, receive), send)
        service = await self._get_service(scope)
        if episode is not None:
            try:  # from the pin's lookup to the lease below there is no await: no sync moves it between
                body = episode_capture.prepare_turn(scope["path"].removeprefix(scope.get("root_path", "")),
                                                    body, service.episodes.get(episode))
            except episode_capture.EpisodeRefused as err:
                return await _error(err.code, str(err))(scope, receive, send)
            model = body["model"]
        served = service.table.resolve(model)
        why = service.table.not_served(model) if served is None else None
        if why is not None:
            return await _error(404, why, "NotFoundError", "model")(scope, receive, send)
        name = served.name if served is not None else model  # not ours (the base model): vLLM decides
        if episode is not None:
            pin = Pin(name, served.alias, served.version) if served is not None else Pin(name, None, None)
            send = episode_capture.recording_send(send, service.episodes, episode, pin)
        if name != body["model"] or episode is not None:
            raw = json.dumps({**body, "model": name}).encode()
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(raw)).encode())]}
        if served is None:
            return await self.app(scope, _replay(raw, receive), send)
        async with service.table.lease(served.name):  # taken with no await after the lookup
            await self.app(scope, _replay(raw, receive), send)

    # ---- shutdown ------------------------------------------------------------------------------------
    async def _release(self) -> None:
        """Unmap the trainer's buffers in every worker (a trainer's CUDA IPC ref-counter file goes only
        once every mapping is gone); the server's shutdown goes on whatever happens."""
        try:
            held = await self._service.release(RELEASE_TIMEOUT_S)
            logger.info("engine %s stopping; %d mappings released", self._service.incarnation[:8], held)
        except Exception:  # shutdown goes on
            logger.exception("releasing the trainer's buffers failed")
