"""The Tinker HTTP API (`/api/v1/...`, as the tinker 0.38.0 SDK calls it), on Starlette.

Every training call is queued on the ledger and answered at once with a request id; `/retrieve_future` holds
the poll until the worker finishes it. A request refused outright gets a 4xx with a JSON body (`detail`); a
call that fails while it runs fails its future with `{"error", "category"}`, which the SDK raises as
`RequestFailedError`. Only `[service] api_keys` get in, and each key sees only its own sessions and models.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from titan_lora.service.futures import FutureStore, Result
from titan_lora.service.ledger import Ledger, Op, RequestError
from titan_lora.service.sampling import Sampling
from titan_lora.service.slots import AdamStep, SlotSpec
from titan_lora.service.wire import WireError, read_forward_backward

logger = logging.getLogger(__name__)

POLL_HOLD_S = 30.0
"""How long a `/retrieve_future` poll is held before "try again" (the SDK's poll timeout is 45 s)."""


@dataclass(frozen=True)
class ServedModel:
    """The base model the service offers: its name for clients, its tokenizer and its limits."""

    name: str
    tokenizer_dir: str
    max_rank: int
    max_seq_len: int
    max_queued: int


class Api:
    """The routes, over one ledger and one future store."""

    def __init__(self, served: ServedModel, keys: set[str], ledger: Ledger, futures: FutureStore,
                 sampling: Sampling | None = None) -> None:
        """`sampling`: sampler paths and sessions over the engine (None: sampling is not served)."""
        self.served, self.keys, self.ledger, self.futures = served, keys, ledger, futures
        self.sampling = sampling

    def app(self) -> Starlette:
        """The ASGI app."""
        post = {
            "client/config": self.client_config, "client/dynamic_config": self.empty,
            "create_session": self.create_session, "session_heartbeat": self.heartbeat,
            "telemetry": self.telemetry, "create_model": self.create_model, "get_info": self.get_info,
            "forward_backward": self.forward_backward, "optim_step": self.optim_step,
            "save_weights": self.save_weights, "load_weights": self.load_weights,
            "retrieve_future": self.retrieve_future, "save_weights_for_sampler": self.save_for_sampler,
            "asample": self.sample, "create_sampling_session": self.create_sampling_session,
        }
        routes = [Route(f"/api/v1/{path}", self._guard(handler), methods=["POST"]) for path, handler in post.items()]
        routes += [Route("/api/v1/sessions/{session}/finish", self._guard(self.finish_session), methods=["POST"]),
                   Route("/api/v1/healthz", self.healthz, methods=["GET"]),
                   Route("/api/v1/get_server_capabilities", self._guard(self.capabilities), methods=["GET"]),
                   Route("/api/v1/samplers/{sampler}", self._guard(self.sampler_info), methods=["GET"])]
        return Starlette(routes=routes)

    def _guard(self, handler: Callable[[Request, str], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def guarded(request: Request) -> Response:
            key = request.headers.get("x-api-key", "")
            if key not in self.keys:
                return JSONResponse({"detail": "unknown API key: pass one of [service] api_keys as X-API-Key "
                                               "(TINKER_API_KEY)"}, 401)
            try:
                return await handler(request, key)
            except RequestError as err:
                return JSONResponse({"detail": str(err)}, err.status)
            except (WireError, ValueError, KeyError, TypeError) as err:
                return JSONResponse({"detail": f"bad request: {err}"}, 400)
        return guarded

    async def healthz(self, request: Request) -> Response:
        """Liveness."""
        return JSONResponse({"status": "ok"})

    async def empty(self, request: Request, key: str) -> Response:
        """Calls that need no answer (heartbeat, dynamic config, finish)."""
        return JSONResponse({})

    async def client_config(self, request: Request, key: str) -> Response:
        """The SDK's feature flags: the defaults, except one chunk per forward_backward call (the service
        orders chunks by seq_id anyway)."""
        return JSONResponse({"pjwt_auth_enabled": False, "proto_compress_fwdbwd": False})

    async def telemetry(self, request: Request, key: str) -> Response:
        """The SDK's telemetry, accepted and dropped."""
        return JSONResponse({"status": "accepted"})

    async def capabilities(self, request: Request, key: str) -> Response:
        """The base model served."""
        return JSONResponse({"supported_models": [{"model_name": self.served.name, "trainable": True,
                                                   "sampleable": self.sampling is not None,
                                                   "max_context_length": self.served.max_seq_len}]})

    async def heartbeat(self, request: Request, key: str) -> Response:
        """The SDK's beat every 10 s: the session lives on (a session silent for long ends)."""
        body = await request.json()
        try:
            self.ledger.own_session(body["session_id"], key)
        except RequestError:
            return JSONResponse({"detail": "the session has ended"}, 410)  # the SDK stops beating
        return JSONResponse({})

    async def finish_session(self, request: Request, key: str) -> Response:
        """`ServiceClient.close()`: the session's training clients end; their slots are free again."""
        self.ledger.finish_session(request.path_params["session"], key)
        return JSONResponse({})

    async def create_session(self, request: Request, key: str) -> Response:
        """A session for this key."""
        return JSONResponse({"session_id": self.ledger.new_session(key), "type": "create_session"})

    def _room(self, key: str) -> None:
        if self.futures.pending(key) >= self.served.max_queued:
            raise RequestError(f"this API key has {self.served.max_queued} calls unfinished ([service] max_queued):"
                               " wait for some to finish", 429)

    async def create_model(self, request: Request, key: str) -> Response:
        """`create_lora_training_client`: a LoRA of the asked rank on a free slot."""
        body = await request.json()
        self.ledger.own_session(body["session_id"], key)
        if body.get("base_model") != self.served.name:
            raise RequestError(f"base_model {body.get('base_model')!r} is not served; this service serves "
                               f"{self.served.name!r}", 404)
        lora = body.get("lora_config") or {}
        rank = int(lora.get("rank", 32))
        if not 1 <= rank <= self.served.max_rank:
            raise RequestError(f"LoRA rank {rank} is outside 1..{self.served.max_rank} ([service] max_rank)")
        optimizer = (body.get("optimizer_config") or {}).get("type", "adamw")
        if optimizer != "adamw":
            raise RequestError(f"optimizer {optimizer!r} is not served; titan_lora serves adamw")
        spec = SlotSpec(rank=rank, seed=int(lora.get("seed") or 0), train_attn=lora.get("train_attn", True),
                        train_mlp=lora.get("train_mlp", True), train_unembed=lora.get("train_unembed", True))
        return self._create(key, body["session_id"], f"{body['session_id']}:train:{body['model_seq_id']}", spec)

    async def get_info(self, request: Request, key: str) -> Response:
        """The model's base, tokenizer and LoRA rank."""
        body = await request.json()
        model = self.ledger.model(body["model_id"], key)
        return JSONResponse({
            "type": "get_info", "model_id": body["model_id"], "is_lora": True, "lora_rank": model.spec.rank,
            "model_name": self.served.name,
            "model_data": {"model_name": self.served.name, "tokenizer_id": self.served.tokenizer_dir},
        })

    def _queue(self, key: str, model_id: str, seq_id: int, kind: str, args: object) -> Response:
        self.ledger.model(model_id, key)
        request_id = self.ledger.sent(model_id, seq_id)  # the SDK's resend of a call: the same future, run once
        if request_id is None:
            self._room(key)
            request_id = self.ledger.submit(model_id, seq_id, Op(kind, model_id, self.futures.new(key), args))
        return JSONResponse({"request_id": request_id, "model_id": model_id})

    def _create(self, key: str, session: str, model_id: str, spec: SlotSpec, args: object = None) -> Response:
        request_id = self.futures.new(key)
        try:
            self.ledger.create(key, session, model_id, spec, request_id, args)
        except RequestError as err:
            self.futures.finish(request_id, Result(error=str(err)))  # not left pending
            raise
        return JSONResponse({"request_id": request_id, "model_id": model_id})

    async def forward_backward(self, request: Request, key: str) -> Response:
        """`forward` / `forward_backward`: a protobuf request, checked when it runs (a bad one fails alone)."""
        call = read_forward_backward(await request.body())
        return self._queue(key, call.model_id, call.seq_id, "forward_backward", call)

    async def optim_step(self, request: Request, key: str) -> Response:
        """`optim_step` with AdamParams: steps this model's adapter only."""
        body = await request.json()
        params = body.get("adam_params")
        if params is None:
            raise RequestError("optim_step without adam_params: titan_lora serves AdamW only")
        adam = AdamStep(**{k: float(params[k]) for k in AdamStep.__dataclass_fields__ if k in params})
        return self._queue(key, body["model_id"], int(body["seq_id"]), "optim_step", adam)

    async def save_weights(self, request: Request, key: str) -> Response:
        """`save_state`: the adapter and its optimizer state, kept across service restarts."""
        body = await request.json()
        return self._queue(key, body["model_id"], int(body["seq_id"]), "save_state", str(body["path"]))

    async def load_weights(self, request: Request, key: str) -> Response:
        """`load_state[_with_optimizer]`, or a new training client made from a state."""
        body = await request.json()
        args = (str(body["path"]), bool(body.get("optimizer", False)))
        if "model_id" in body:
            return self._queue(key, body["model_id"], int(body["seq_id"]), "load_state", args)
        self.ledger.own_session(body["session_id"], key)
        return self._create(key, body["session_id"], f"{body['session_id']}:train:{body['model_seq_id']}",
                            SlotSpec(rank=1), args)  # the state's own spec replaces it

    def _sampling(self) -> Sampling:
        if self.sampling is None:
            raise RequestError("sampling is not served: this service runs with [weight_sync] enabled = false "
                               "(no engine); it serves forward, forward_backward, optim_step, save_state and "
                               "load_state")
        return self.sampling

    async def save_for_sampler(self, request: Request, key: str) -> Response:
        """`save_weights_for_sampler` (named: a path) or `save_weights_and_get_sampling_client` (a session)."""
        body = await request.json()
        self._sampling()
        path = body.get("path")
        return self._queue(key, body["model_id"], int(body["seq_id"]), "save_for_sampler",
                           (None if path is None else str(path), path is None))

    async def create_sampling_session(self, request: Request, key: str) -> Response:
        """A sampling client on a saved sampler path, or on the base model."""
        body = await request.json()
        self.ledger.own_session(body["session_id"], key)
        path = body.get("model_path")
        if path is None and body.get("base_model") != self.served.name:
            raise RequestError(f"base_model {body.get('base_model')!r} is not served; this service serves "
                               f"{self.served.name!r}", 404)
        if path is not None and not self._sampling().has(key, path):
            await self._reload(key, path)
        session = self._sampling().open(key, path)
        return JSONResponse({"sampling_session_id": session, "type": "create_sampling_session"})

    async def _reload(self, key: str, path: str) -> None:
        """Named sampler weights the engine does not hold (saved before a restart of the service) back into it
        by the worker; what `open` then finds, or not."""
        request_id = self.futures.new(key)
        try:
            self.ledger.borrow(request_id, path, key)
        except RequestError as err:
            self.futures.finish(request_id, Result(error=str(err)))  # not left pending
            raise
        while (result := await self.futures.wait(request_id, POLL_HOLD_S)) is None:
            pass
        if result.error is not None and "no saved state" not in result.error:
            raise RequestError(f"{path} could not be reloaded into the engine: {result.error}")

    async def sampler_info(self, request: Request, key: str) -> Response:
        """What a sampling session samples from."""
        session = self._sampling().session(request.path_params["sampler"], key)
        return JSONResponse({"sampler_id": request.path_params["sampler"], "base_model": self.served.name,
                             "model_path": session.path})

    async def sample(self, request: Request, key: str) -> Response:
        """`sample` / `compute_logprobs`: drawn from the engine under the session's version."""
        body = await request.json()
        self._room(key)
        return JSONResponse(self._sampling().submit(key, body))

    async def retrieve_future(self, request: Request, key: str) -> Response:
        """The future's result once ready, held up to POLL_HOLD_S; then "try again"."""
        body = await request.json()
        request_id = body["request_id"]
        if not self.futures.owned(request_id, key):
            raise RequestError(f"request {request_id!r} is not one of this API key's", 404)
        result = await self.futures.wait(request_id, POLL_HOLD_S)
        if result is None:
            return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        return answer(result)


def answer(result: Result) -> Response:
    """A finished future as the SDK reads it."""
    if result.error is not None:
        return JSONResponse({"error": result.error, "category": result.category})
    if result.proto is not None:
        return Response(result.proto, media_type="application/x-protobuf")
    return JSONResponse(result.json)
