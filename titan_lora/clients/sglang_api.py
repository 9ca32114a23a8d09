"""HTTP client for an SGLang 0.5.23 server: the weight-sync control plane and `/generate`.

The request bodies mirror the structs of `sglang/srt/managers/io_struct.py` in 0.5.23, field for
field (names, types, defaults), for the fields titan_lora sets. SGLang ignores unknown fields in
these bodies, so a misspelled field would be a silent no-op: keep the names exact.

The client only talks to the one scheme://host:port it was given. It uses `http.client` directly,
so it follows no redirect and reads no proxy variable: neither a body nor the API key can reach a
host that the config did not name.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import logging
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from titan_lora.clients.rollout import REFUSED_STATUSES, RequestRefused
from titan_lora.clients.sglang_generate import GenerateOutput, GenerateReqInput, generate_output
from titan_lora.clients.sockets import OpenSockets
from titan_lora.transfer.errors import EngineHung, TransferError

logger = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"
# Routes marked ADMIN_OPTIONAL in 0.5.23's http_server.py: with --admin-api-key set they take only that
# key (utils/auth.py); every other route takes only --api-key.
ADMIN_PATHS = frozenset({
    "/begin_weight_update", "/end_weight_update", "/update_weights_from_tensor", "/get_weights_by_name",
    "/load_lora_adapter_from_tensors", "/unload_lora_adapter", "/pause_generation", "/continue_generation",
    "/flush_cache", "/release_memory_occupation", "/resume_memory_occupation"})


def _is_admin(path: str) -> bool:
    """Whether `path` (query string ignored) is a route that takes the admin key."""
    return path.split("?", 1)[0] in ADMIN_PATHS


PauseMode = Literal["abort", "retract", "in_place"]


class SGLangError(TransferError):
    """SGLang refused a request, answered something unexpected, or could not be reached."""


class SGLangAuthError(SGLangError):
    """SGLang rejected the API key (401) or the endpoint needs its admin key (403)."""


class SGLangRefused(SGLangError, RequestRefused):
    """SGLang refused the request itself (HTTP 400, 413 or 422: e.g. a prompt over its context length)."""


class SGLangTimeout(SGLangError, EngineHung):
    """A request got no complete answer within its deadline: an engine fault, as a wedged server's."""


# ---- request bodies (io_struct.py, 0.5.23) -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BeginWeightUpdateReqInput:
    """Opens the weight-update session that `/update_weights_from_tensor` requires."""

    selector: Literal["target", "draft", "all"] = "all"


@dataclasses.dataclass(frozen=True)
class EndWeightUpdateReqInput:
    """Closes the weight-update session (no fields)."""


@dataclasses.dataclass(frozen=True)
class UpdateWeightsFromTensorReqInput:
    """Base weights: one base64 MultiprocessingSerializer payload per engine TP rank."""

    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


@dataclasses.dataclass(frozen=True)
class LoadLoRAAdapterFromTensorsReqInput:
    """An adapter from tensors: PEFT adapter_config plus one payload per engine TP rank."""

    lora_name: str
    config_dict: dict[str, Any]
    serialized_named_tensors: list[str]
    pinned: bool = False
    load_format: str | None = None
    expected_checksums: dict[str, str] | None = None


@dataclasses.dataclass(frozen=True)
class UnloadLoRAAdapterReqInput:
    """Unload one adapter by name."""

    lora_name: str


@dataclasses.dataclass(frozen=True)
class PauseGenerationReqInput:
    """Pause the scheduler: abort, retract or keep (in_place) the running requests."""

    mode: PauseMode = "abort"


@dataclasses.dataclass(frozen=True)
class ContinueGenerationReqInput:
    """Resume after `/pause_generation`."""

    torch_empty_cache: bool = True


@dataclasses.dataclass(frozen=True)
class MemoryOccupationReqInput:
    """Body of `/release_memory_occupation` and `/resume_memory_occupation` (same fields in both)."""

    tags: list[str] | None = None


@dataclasses.dataclass(frozen=True)
class GetWeightsByNameReqInput:
    """The first `truncate_size` rows of one served parameter, by its HF name."""

    name: str
    truncate_size: int = 100


def _body(req: object) -> dict[str, Any]:
    # None is every optional field's default, so leaving it out keeps the body minimal. No
    # dataclasses.asdict: it would deep-copy the (large) payload strings.
    fields = dataclasses.fields(req)  # type: ignore[arg-type]
    return {f.name: getattr(req, f.name) for f in fields if getattr(req, f.name) is not None}


# ---- responses -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ServerInfo:
    """The part of `/server_info` (resolved server arguments) that LoRA weight sync depends on."""

    version: str
    enable_lora: bool
    max_lora_rank: int | None
    lora_target_modules: frozenset[str] | None
    max_loaded_loras: int | None
    max_loras_per_batch: int
    tp_size: int
    dp_size: int
    attn_dp_size: int = 1  # dp_size with --enable-dp-attention, else 1
    enable_memory_saver: bool = False
    device: str | None = None
    deterministic_inference: bool = False  # --enable-deterministic-inference: honours sampling_seed

    @classmethod
    def from_json(cls, info: Mapping[str, Any]) -> ServerInfo:
        """Parse `/server_info`; raises if a field SGLang 0.5.23 reports is missing."""
        keys = ("enable_lora", "max_lora_rank", "lora_target_modules", "max_loaded_loras",
                "max_loras_per_batch", "tp_size", "dp_size", "enable_dp_attention", "enable_memory_saver")
        missing = [k for k in keys if k not in info]
        if missing:
            raise SGLangError(
                f"/server_info lacks {missing}: is this an SGLang {SGLANG_VERSION} server "
                f"(it reports version {info.get('version')!r})?"
            )
        targets = info["lora_target_modules"]
        return cls(
            version=str(info.get("version", "")),
            enable_lora=bool(info["enable_lora"]),
            max_lora_rank=info["max_lora_rank"],
            lora_target_modules=None if targets is None else frozenset(targets),
            max_loaded_loras=info["max_loaded_loras"],
            max_loras_per_batch=int(info["max_loras_per_batch"]),
            tp_size=int(info["tp_size"]),
            dp_size=int(info["dp_size"]),
            attn_dp_size=int(info["dp_size"]) if info["enable_dp_attention"] else 1,
            enable_memory_saver=bool(info["enable_memory_saver"]),
            device=info.get("device"),
            deterministic_inference=bool(info.get("enable_deterministic_inference", False)),
        )


@dataclasses.dataclass(frozen=True)
class ControlResult:
    """Outcome of a control call: `success` with `message`, and the adapters loaded after a LoRA call."""

    success: bool
    message: str
    loaded_adapters: Mapping[str, Any] | None = None


def _error_text(payload: Any) -> str:
    """The message out of SGLang's several error shapes."""
    if isinstance(payload, dict):
        for key in ("error_message", "message", "error"):
            value = payload.get(key)
            if isinstance(value, dict):
                value = value.get("message")
            if value:
                return str(value)
    return str(payload)[:500]


# ---- transport -----------------------------------------------------------------------------------


class _NotDelivered(Exception):
    """The connection failed before any byte of the request was sent: safe to retry."""


class SGLangClient:
    """Blocking client for one SGLang 0.5.23 server; thread-safe (one connection per request)."""

    def __init__(self, url: str, api_key: str = "", timeout_s: float = 120.0, retries: int = 3,
                 admin_api_key: str = "") -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"[engine] url = {url!r} is not an http(s) URL; "
                "give the server root, e.g. http://127.0.0.1:30000"
            )
        if parts.path.strip("/") or parts.query or parts.fragment or parts.username:
            raise ValueError(
                f"[engine] url = {url!r}: give only scheme://host:port of the server root; "
                "the client adds the endpoint paths itself"
            )
        self.url = f"{parts.scheme}://{parts.netloc}"
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._api_key, self._admin_api_key = api_key, admin_api_key
        self.retired: set[str] = set()  # names unloaded through this client: never generate on them
        self.timeout_s = timeout_s
        self.retries = retries
        self.open = OpenSockets()  # the connections of requests in flight: `interrupt` ends them
        self._interrupt_reason = ""

    def interrupt(self, reason: str) -> None:
        """End every request in flight at once (the server was found wedged): each raises EngineHung."""
        self._interrupt_reason = reason
        self.open.wake_all()

    def check_live(self, timeout_s: float) -> None:
        """Raise EngineHung unless `/health_generate` (SGLang runs a one-token generation through its
        scheduler unless it is already busy) answers 200 within `timeout_s`."""
        status, payload = self._call("GET", "/health_generate", timeout_s=timeout_s, retry=False)
        if status != 200:
            raise EngineHung(f"SGLang at {self.url} failed /health_generate ({status}): its scheduler is "
                             f"wedged or dead: {_error_text(payload)}")

    @property
    def host_port(self) -> tuple[str, int]:
        """The server's host and port, as configured."""
        return self._host, self._port

    def _connect(self, timeout_s: float) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = cls(self._host, self._port, timeout=timeout_s)
        try:
            conn.connect()
        except OSError as err:  # refused, unreachable, connect timeout: nothing was sent
            conn.close()
            raise _NotDelivered(str(err)) from err
        return conn

    def _key(self, path: str) -> str:
        """The key `path` takes: the admin key on admin routes (if we have one), else the API key."""
        return (self._admin_api_key or self._api_key) if _is_admin(path) else self._api_key

    def _once(self, method: str, path: str, body: bytes | None, timeout_s: float) -> tuple[int, bytes]:
        deadline = time.monotonic() + timeout_s
        conn = self._connect(timeout_s)
        self.open.add(conn.sock)
        headers = {"Content-Type": "application/json"}
        if key := self._key(path):
            headers["Authorization"] = f"Bearer {key}"
        try:
            # Socket timeouts are per operation; re-arming them from one deadline bounds the call.
            conn.sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            conn.request(method, path, body=body, headers=headers)
            conn.sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            resp = conn.getresponse()
            return resp.status, resp.read()
        except TimeoutError as err:  # socket.timeout is TimeoutError since Python 3.10
            raise SGLangTimeout(
                f"SGLang at {self.url} did not answer {path} within {timeout_s:.1f}s; "
                "raise [weight_sync] timeout_s if the server is just slow"
            ) from err
        finally:
            self.open.discard(conn.sock)
            conn.close()

    def _call(self, method: str, path: str, body: Any = None, *, timeout_s: float | None = None,
              idempotent: bool = False, retry: bool = True) -> tuple[int, Any]:
        """One request; retried when nothing was delivered, or on any failure if `idempotent`."""
        data = None if body is None else json.dumps(body).encode()
        timeout = self.timeout_s if timeout_s is None else timeout_s
        retries = self.retries if retry else 0
        wakes = self.open.wakes
        for attempt in range(retries + 1):
            try:
                status, raw = self._once(method, path, data, timeout)
                break
            except _NotDelivered as err:
                if attempt == retries:
                    raise SGLangError(
                        f"cannot reach SGLang at {self.url} for {path} ({err}) after {attempt + 1} "
                        "attempt(s): start the server or fix [engine] url"
                    ) from err
            except (ConnectionError, http.client.HTTPException) as err:
                if self.open.wakes != wakes:  # `interrupt` ended it: never resent
                    raise EngineHung(f"SGLang at {self.url}: {path} abandoned: {self._interrupt_reason}") \
                        from None
                if not idempotent or attempt == retries:
                    raise SGLangError(f"the connection to SGLang at {self.url} broke during {path} ({err}); "
                                      "the server may have crashed or restarted") from err
            time.sleep(min(0.2 * 2**attempt, 2.0))
        try:
            payload = json.loads(raw) if raw else None
        except ValueError:
            payload = raw.decode(errors="replace")
        self._raise_for_auth(status, path)
        if 300 <= status < 400:
            raise SGLangError(f"SGLang at {self.url} answered {path} with a redirect ({status}); "
                              "titan_lora follows none: point [engine] url at the server")
        if status == 404:
            raise SGLangError(f"SGLang at {self.url} has no {path} (404): this client speaks the "
                              f"HTTP API of SGLang {SGLANG_VERSION}; check the server version")
        return status, payload

    def _raise_for_auth(self, status: int, path: str) -> None:
        if status == 403:
            raise SGLangAuthError(
                f"SGLang at {self.url} forbids {path} (403): the endpoint needs the server's "
                "--admin-api-key; start the server with one and set [engine] admin_api_key to it"
            )
        if status != 401:
            return
        if _is_admin(path):
            # With both --api-key and --admin-api-key set, these routes take only the admin key.
            fix = ("[engine] admin_api_key to the server's --admin-api-key (or api_key to its --api-key "
                   "if it has no admin key)")
        else:
            fix = "[engine] api_key to the server's --api-key (these routes never take the admin key)"
        problem = "rejected the API key on" if self._key(path) else "requires an API key on"
        raise SGLangAuthError(f"SGLang at {self.url} {problem} {path} (401 Unauthorized): set {fix}")

    def _ok(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        """A call that must answer 200; anything else raises with the server's message."""
        status, payload = self._call(method, path, body, **kw)
        if status != 200:
            raise SGLangError(f"SGLang {path} failed ({status}): {_error_text(payload)}")
        return payload

    def _control(self, path: str, req: object, **kw: Any) -> ControlResult:
        # SGLang answers these with 200 or 400 and a `success` flag; the caller decides what to do.
        status, payload = self._call("POST", path, _body(req), **kw)
        if not isinstance(payload, dict) or "success" not in payload:
            raise SGLangError(f"SGLang {path} answered {status} without a success flag: "
                              f"{_error_text(payload)}")
        ok = bool(payload["success"])
        message = str(payload.get("message") or "") if ok else _error_text(payload)
        return ControlResult(ok, message, payload.get("loaded_adapters"))

    # ---- endpoints -------------------------------------------------------------------------------

    def server_info(self) -> ServerInfo:
        """`GET /server_info` (the non-deprecated name of `/get_server_info`)."""
        return ServerInfo.from_json(self._ok("GET", "/server_info", idempotent=True))

    def weight_version(self) -> str:
        """The weight version the server serves now (`/model_info`); it resets when the server restarts."""
        return str(self._ok("GET", "/model_info", idempotent=True)["weight_version"])

    def get_weights_by_name(self, name: str, truncate_size: int) -> list[Any] | None:
        """The first `truncate_size` rows of served parameter `name` as float lists; None: no such name.

        SGLang's model runner catches the model's error and answers None for a name it does not have.
        """
        status, payload = self._call("POST", "/get_weights_by_name",
                                     _body(GetWeightsByNameReqInput(name, truncate_size)), idempotent=True)
        return payload if status == 200 and isinstance(payload, list) else None

    def begin_weight_update(self) -> ControlResult:
        """`POST /begin_weight_update`."""
        return self._control("/begin_weight_update", BeginWeightUpdateReqInput())

    def end_weight_update(self) -> ControlResult:
        """`POST /end_weight_update`."""
        return self._control("/end_weight_update", EndWeightUpdateReqInput())

    def update_weights_from_tensor(self, req: UpdateWeightsFromTensorReqInput) -> ControlResult:
        """`POST /update_weights_from_tensor` (inside a begin/end weight-update session)."""
        return self._control("/update_weights_from_tensor", req)

    def load_lora_adapter_from_tensors(self, req: LoadLoRAAdapterFromTensorsReqInput) -> ControlResult:
        """`POST /load_lora_adapter_from_tensors`."""
        res = self._control("/load_lora_adapter_from_tensors", req)
        if res.success:
            self.retired.discard(req.lora_name)
        return res

    def unload_lora_adapter(self, lora_name: str, timeout_s: float) -> ControlResult:
        """`POST /unload_lora_adapter`, bounded by `timeout_s` and never retried (it may be queued)."""
        req = UnloadLoRAAdapterReqInput(lora_name)
        self.retired.add(lora_name)  # unregistered as soon as the server takes the unload
        res = self._control("/unload_lora_adapter", req, timeout_s=timeout_s, retry=False)
        if not res.success and "does not exist" not in res.message:
            self.retired.discard(lora_name)  # refused: the server still holds it
        return res

    def pause_generation(self, mode: PauseMode) -> None:
        """`POST /pause_generation`."""
        self._ok("POST", "/pause_generation", _body(PauseGenerationReqInput(mode)))

    def continue_generation(self) -> None:
        """`POST /continue_generation`."""
        self._ok("POST", "/continue_generation", _body(ContinueGenerationReqInput()))

    def flush_cache(self, wait_idle_s: float = 0.0) -> bool:
        """`POST /flush_cache?timeout=...`: flush once the server is idle, waiting up to `wait_idle_s`."""
        status, _ = self._call("POST", f"/flush_cache?timeout={wait_idle_s:g}",
                               timeout_s=self.timeout_s + wait_idle_s)
        return status == 200

    def release_kv_cache(self) -> None:
        """Free the KV cache only (tags ["kv_cache"]): adapter mode never releases the weights."""
        self._ok("POST", "/release_memory_occupation", _body(MemoryOccupationReqInput(["kv_cache"])))

    def resume_kv_cache(self) -> None:
        """Re-allocate the KV cache released by `release_kv_cache`."""
        self._ok("POST", "/resume_memory_occupation", _body(MemoryOccupationReqInput(["kv_cache"])))

    def generate(self, prompt_or_ids: str | Sequence[int], lease_name: str | None,
                 sampling_params: Mapping[str, Any], *, logprob_start_len: int | None = None,
                 timeout_s: float | None = None) -> GenerateOutput:
        """One rollout on adapter `lease_name` (from `AdapterVersions.lease()`; None: the base).

        `logprob_start_len=0` also returns the prompt's log-probs (for the parity probe).
        """
        text, ids = (prompt_or_ids, None) if isinstance(prompt_or_ids, str) else (None, list(prompt_or_ids))
        req = GenerateReqInput(text=text, input_ids=ids, sampling_params=dict(sampling_params),
                               lora_path=lease_name, return_logprob=True, logprob_start_len=logprob_start_len)
        return self._generate(req, timeout_s)[0]

    def generate_batch(self, req: GenerateReqInput, timeout_s: float | None = None) -> list[GenerateOutput]:
        """One `/generate` for a batch (`req.input_ids` a list of lists): one answer per prompt, in order."""
        out = self._generate(req, timeout_s)
        if len(out) != len(req.input_ids or []):
            raise SGLangError(f"SGLang at {self.url} answered {len(out)} completions for a batch of "
                              f"{len(req.input_ids or [])} prompts")
        return out

    def _generate(self, req: GenerateReqInput, timeout_s: float | None) -> list[GenerateOutput]:
        if req.lora_path in self.retired:
            # SGLang would reload a retired name from its placeholder path "__tensor__": a blocking hub
            # download inside the scheduler, before it fails.
            raise SGLangError(f"adapter {req.lora_path!r} was retired from SGLang at {self.url}; take the "
                              "name from AdapterVersions.lease(), which never hands out a retired version")
        status, out = self._call("POST", "/generate", _body(req), timeout_s=timeout_s)
        answers = out if isinstance(out, list) else [out]
        if status != 200 or not all(isinstance(a, dict) and "meta_info" in a for a in answers):
            error = SGLangRefused if status in REFUSED_STATUSES else SGLangError  # the request's fault?
            raise error(f"SGLang /generate failed ({status}) on adapter {req.lora_path!r}: {_error_text(out)}")
        return [generate_output(a, req.logprob_start_len == 0) for a in answers]
