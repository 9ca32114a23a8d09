"""A conformance server that plays SGLang 0.5.23's HTTP surface, for CPU tests of the SGLang emitter.

Written from SGLang's source (http_server.py, io_struct.py, tokenizer_control_mixin.py, lora_registry.py,
tp_worker.py, utils/common.py), independently of the client under test:
- bodies are checked against the 0.5.23 structs: field names, types, required fields;
- tensor payloads are base64-decoded and unpickled under SGLang's SafeUnpickler allow-list, then read in
  the `flattened_bucket` or plain format, with `expected_checksums` checked as SGLang does;
- the base goes into a HF LlamaForCausalLM, adapters go in through PEFT; `/generate` serves them;
- LoRA semantics follow SGLang: one lora_update_lock for loads and unloads, an unload that first
  unregisters the name then waits for the adapter's in-flight requests (so it blocks, and blocks later
  loads too), LRU eviction beyond --max-loaded-loras, scaling lora_alpha / r (use_rslora ignored).
Stricter than SGLang where a lax server would hide a client bug: unknown fields are refused (SGLang
ignores them outside sampling_params), an adapter load before the base update is refused (an engine
started with dummy weights would serve garbage), and shared-memory tensor handles are refused, as an
engine on another host could not open them. `restart()` loses weights, adapters and weight_version.
"""

from __future__ import annotations

import base64
import binascii
import collections
import contextlib
import dataclasses
import hashlib
import io
import itertools
import json
import pickle
import threading
import time
import urllib.parse
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import torch
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from torch.multiprocessing import reductions
from transformers import LlamaConfig, LlamaForCausalLM


class Refused(Exception):
    """The request is answered with an error `body` and HTTP `status`."""

    def __init__(self, body: Any, status: int = 400) -> None:
        super().__init__(str(body))
        self.body, self.status = body, status


# ---- request schemas (io_struct.py 0.5.23; BaseReq adds rid and http_worker_ipc) ------------------

def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _b64(v: Any) -> bool:
    try:
        return isinstance(v, str) and base64.b64decode(v, validate=True) is not None
    except binascii.Error:
        return False


STR, BOOL, INT = (lambda v: isinstance(v, str)), (lambda v: isinstance(v, bool)), _int
NUM = lambda v: _int(v) or isinstance(v, float)  # noqa: E731
OPT = lambda t: lambda v: v is None or t(v)  # noqa: E731
LIST = lambda t: lambda v: isinstance(v, list) and all(t(x) for x in v)  # noqa: E731
DICT = lambda t: lambda v: isinstance(v, dict) and all(isinstance(k, str) and t(x) for k, x in v.items())  # noqa: E731
LIT = lambda *ok: lambda v: v in ok  # noqa: E731
SELECTOR = LIT("target", "draft", "all")
BASE_REQ = {"rid": OPT(STR), "http_worker_ipc": OPT(STR)}
SCHEMAS: dict[str, tuple[dict[str, Callable], dict[str, Callable]]] = {  # path: (required, optional)
    "/begin_weight_update": ({}, {"selector": SELECTOR}),
    "/end_weight_update": ({}, {}),
    "/update_weights_from_tensor": ({"serialized_named_tensors": LIST(_b64)}, {
        "load_format": OPT(STR), "flush_cache": BOOL, "abort_all_requests": BOOL, "weight_version": OPT(STR),
        "selector": SELECTOR, "torch_empty_cache": BOOL}),
    "/load_lora_adapter_from_tensors": (
        {"lora_name": STR, "config_dict": DICT(lambda v: True), "serialized_named_tensors": LIST(_b64)},
        {"pinned": BOOL, "added_tokens_config": OPT(DICT(INT)), "lora_id": OPT(STR), "load_format": OPT(STR),
         "expected_checksums": OPT(DICT(STR))}),
    "/unload_lora_adapter": ({"lora_name": STR}, {"lora_id": OPT(STR)}),
    "/pause_generation": ({}, {"mode": LIT("abort", "retract", "in_place")}),
    "/continue_generation": ({}, {"torch_empty_cache": BOOL}),
    "/release_memory_occupation": ({}, {"tags": OPT(LIST(LIT("kv_cache", "weights", "cuda_graph")))}),
    "/resume_memory_occupation": ({}, {"tags": OPT(LIST(LIT("kv_cache", "weights", "cuda_graph")))}),
    "/generate": ({}, {"text": OPT(STR), "input_ids": OPT(LIST(INT)), "sampling_params": OPT(DICT(lambda v: True)),
                       "lora_path": OPT(STR), "return_logprob": OPT(BOOL), "logprob_start_len": OPT(INT),
                       "stream": BOOL, "top_logprobs_num": OPT(INT), "return_text_in_logprobs": BOOL}),
}
# api/v1 SamplingParams: SGLang itself rejects unknown keys here, with this serde-style message.
SAMPLING = {"max_new_tokens": OPT(INT), "temperature": OPT(NUM), "top_p": OPT(NUM), "top_k": OPT(INT),
            "min_p": OPT(NUM), "stop": lambda v: True, "stop_token_ids": OPT(LIST(INT)), "ignore_eos": OPT(BOOL),
            "n": OPT(INT), "sampling_seed": OPT(INT), "min_new_tokens": OPT(INT), "repetition_penalty": OPT(NUM),
            "frequency_penalty": OPT(NUM), "presence_penalty": OPT(NUM), "skip_special_tokens": OPT(BOOL)}


def validate(path: str, body: Any) -> None:
    """Refuse a body that does not match the 0.5.23 struct of `path` (400, SGLang's validation shape)."""
    required, optional = SCHEMAS[path]
    fields = {**BASE_REQ, **required, **optional}
    problems = [f"missing field `{k}`" for k in required if k not in body] if isinstance(body, dict) else ["not a JSON object"]
    for key, value in (body.items() if isinstance(body, dict) else ()):
        if key not in fields:
            problems.append(f"unknown field `{key}` (SGLang 0.5.23 would silently ignore it)")
        elif not fields[key](value):
            problems.append(f"field `{key}` has the wrong type: {type(value).__name__}")
    for key, value in ((body.get("sampling_params") or {}) if not problems else {}).items():
        if key not in SAMPLING:
            known = ", ".join(f"`{k}`" for k in SAMPLING)
            problems.append(f"unknown field `{key}`, expected one of {known}")
        elif not SAMPLING[key](value):
            problems.append(f"invalid type for sampling param `{key}`")
    if problems:
        raise Refused({"object": "error", "message": "; ".join(problems), "type": "Bad Request", "code": 400})


# ---- payload decoding (SafeUnpickler policy of sglang/srt/utils/common.py) ------------------------

_ALLOWED = {("builtins", n) for n in "dict list tuple set frozenset int float bool str bytes bytearray".split()} | {
    ("collections", "OrderedDict"), ("copyreg", "__newobj__"), ("types", "SimpleNamespace"), ("torch", "Size"),
    ("torch", "Tensor"), ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_parameter"),
    ("torch.nn.parameter", "Parameter"), ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"), ("torch.multiprocessing.reductions", "rebuild_typed_storage")}
_SHARED_MEMORY = {("torch.multiprocessing.reductions", "rebuild_storage_fd"),
                  ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
                  ("multiprocessing.resource_sharer", "DupFd")}


def _rebuild_cuda_by_uuid(*args: Any) -> torch.Tensor:
    """SGLang's patched rebuild_cuda_tensor: the sender names its GPU by UUID."""
    dev = args[6]
    if isinstance(dev, str):
        dev = next(i for i in range(torch.cuda.device_count()) if str(torch.cuda.get_device_properties(i).uuid) == dev)
    return reductions.rebuild_cuda_tensor(*args[:6], dev, *args[7:])


class SafeUnpickler(pickle.Unpickler):
    """Unpickles only the globals SGLang allows; `remote` refuses handles another host cannot open."""

    def __init__(self, data: bytes, remote: bool) -> None:
        super().__init__(io.BytesIO(data))
        self.remote = remote

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return lambda b: torch.load(io.BytesIO(b), weights_only=True)
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return _rebuild_cuda_by_uuid
        if (module, name) in _SHARED_MEMORY:
            if self.remote:
                raise pickle.UnpicklingError(f"payload holds a shared-memory handle ({module}.{name}) that an "
                                             "engine on another host cannot open; send the tensor bytes")
            return super().find_class(module, name)
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


def decode_tensors(payloads: list[str], tp_size: int, load_format: str | None, remote: bool) -> dict[str, torch.Tensor]:
    """Rank 0's named tensors out of `serialized_named_tensors`, as tp_worker reads them."""
    if len(payloads) != tp_size:
        raise ValueError(f"serialized_named_tensors has {len(payloads)} entries for tp_size={tp_size}")
    data = SafeUnpickler(base64.b64decode(payloads[0], validate=True), remote).load()
    if load_format == "flattened_bucket":
        flat = data["flattened_tensor"]
        named = {m.name: flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape) for m in data["metadata"]}
    elif load_format is None:
        named = dict(data)
    else:
        raise ValueError(f"Unknown load_format={load_format}")
    return {k: v.cpu() for k, v in named.items()}


# ---- the engine ----------------------------------------------------------------------------------

@dataclasses.dataclass
class ServerArgs:
    """The SGLang server flags the conformance server honours."""

    enable_lora: bool = True
    max_lora_rank: int | None = 16
    lora_target_modules: list[str] | None = dataclasses.field(default_factory=lambda: ["all"])
    max_loaded_loras: int | None = None
    max_loras_per_batch: int = 8
    tp_size: int = 1
    dp_size: int = 1
    api_key: str | None = None
    weight_version: str = "default"
    remote: bool = True  # refuse shared-memory handles, as an engine on another host would fail
    gen_delays_s: tuple[float, ...] = (0.0,)  # how long each /generate holds its adapter, cycled


_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj"}


def _normalized(targets: Any) -> set[str]:
    return {"all"} if isinstance(targets, str) or "all" in targets else {_FUSED.get(t, t) for t in targets}


class Engine:
    """One engine incarnation: weights, adapters, LoRA registry, counters and a call log."""

    def __init__(self, model_config: LlamaConfig, args: ServerArgs, seed: int) -> None:
        torch.manual_seed(seed)  # dummy weights, unlike the trainer's: the base must be sent
        self.args, self.model = args, LlamaForCausalLM(model_config).eval()
        self.params = self.model.state_dict()  # aliases the live parameters; survives PEFT wrapping
        self.base_missing = {n for n, _ in self.model.named_parameters()}
        self.peft: Any = None
        self.weight_version = args.weight_version
        self.session_open = False
        self.paused: str | None = None
        self.registry: collections.OrderedDict[str, str] = collections.OrderedDict()  # name -> lora_id, LRU order
        self.counters: dict[str, int] = {}
        self.pending_unloads: dict[str, str] = {}
        self.cond = threading.Condition()
        self.lora_update_lock, self.model_lock = threading.Lock(), threading.Lock()
        self.calls: list[tuple[str, dict]] = []
        self.running = self.loaded_high_water = self.lru_evictions = self.blocked_unloads = 0
        self.released: list[list[str] | None] = []
        self._delays = itertools.cycle(args.gen_delays_s)

    def _decode(self, body: dict) -> dict[str, torch.Tensor]:
        try:
            return decode_tensors(body["serialized_named_tensors"], self.args.tp_size, body.get("load_format"),
                                  self.args.remote)
        except Exception as err:  # SGLang fails the call with the exception text
            raise Refused({"success": False, "message": f"cannot decode tensors: {err}",
                           "error_message": f"cannot decode tensors: {err}"}) from err

    def begin(self, body: dict) -> dict:
        if self.session_open:
            return {"success": False, "message": "a weight-update session is already open; call end_weight_update() first"}
        self.session_open = True
        return {"success": True, "message": "Success"}

    def end(self, body: dict) -> dict:
        if not self.session_open:
            return {"success": False, "message": "no weight-update session is open; call begin_weight_update() first"}
        self.session_open = False
        return {"success": True, "message": "Success"}

    def update_base(self, body: dict) -> dict:
        if not self.session_open:
            return {"success": False, "message": "update_weights_from_tensor must run between "
                    "begin_weight_update() and end_weight_update()"}
        tensors = self._decode(body)
        bad = [n for n, t in tensors.items() if n not in self.params or t.shape != self.params[n].shape]
        if bad:
            return {"success": False, "message": f"Failed to update weights: unknown names or shapes {bad[:5]}"}
        with self.model_lock, torch.no_grad():
            for name, t in tensors.items():
                self.params[name].copy_(t)
                self.base_missing.discard(name)
        if body.get("flush_cache", True) and self.running and self.paused not in ("abort", "retract"):
            return {"success": False, "message": "Weights were updated, but the cache was not flushed because "
                    "requests are still running or queued. Retract or finish them, then call /flush_cache."}
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return {"success": True, "message": "Success"}

    def load_adapter(self, body: dict) -> dict:
        name, cfg = body["lora_name"], body["config_dict"]
        fail = lambda msg: {"success": False, "error_message": msg, "loaded_adapters": dict.fromkeys(self.registry, "__tensor__")}  # noqa: E731
        if not self.args.enable_lora:
            return fail("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        tensors = self._decode(body)
        expected = body.get("expected_checksums")
        if expected is not None:
            got = {n: hashlib.sha256(t.contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()
                   for n, t in tensors.items()}
            if got != expected:
                return fail(f"[LORA-CHECK] rank0 adapter sync MISMATCH of {len(expected)} expected")
        with self.lora_update_lock:
            if name in self.pending_unloads:
                return fail(f"LoRA adapter '{name}' has an incomplete unload. Retry the unload before loading it again.")
            if self.base_missing:
                return fail(f"conformance: the base weights were never loaded into this engine (missing "
                            f"{sorted(self.base_missing)[:3]}); call /update_weights_from_tensor first")
            served = _normalized(self.args.lora_target_modules or [])
            if cfg.get("use_dora"):
                return fail(f"Failed to load {name} because LoRA serving currently doesn't support DoRA adapters")
            if cfg["r"] > self.args.max_lora_rank or not (_normalized(cfg["target_modules"]) <= served or "all" in served):
                return fail(f"LoRA adapter {name} with rank {cfg['r']} is incompatible with the current LoRA memory "
                            "pool configuration. Please ensure that the LoRA adapter's rank is within the configured "
                            "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`.")
            if name in self.registry:
                return fail(f"Failed to load LoRA adapter {name} because it is already loaded")
            try:
                self._install(name, cfg, tensors)
            except Exception as err:
                return fail(str(err))
            with self.cond:
                self.registry[name] = lora_id = f"{name}#{time.monotonic_ns()}"
                self.counters[lora_id] = 0
                self.loaded_high_water = max(self.loaded_high_water, len(self.registry))
            while self.args.max_loaded_loras is not None and len(self.registry) > self.args.max_loaded_loras:
                self.lru_evictions += 1
                self._unload_locked(next(iter(self.registry)))
        return {"success": True, "error_message": "", "loaded_adapters": dict.fromkeys(self.registry, "__tensor__")}

    def _install(self, name: str, cfg: dict, tensors: dict[str, torch.Tensor]) -> None:
        # SGLang's LoRAConfig reads only r, lora_alpha and target_modules (scaling = lora_alpha / r).
        lora = LoraConfig(r=cfg["r"], lora_alpha=cfg["lora_alpha"], target_modules=cfg["target_modules"])
        with self.model_lock:
            if self.peft is None:
                self.peft = get_peft_model(self.model, lora, adapter_name=name)
            else:
                self.peft.add_adapter(name, lora)
            result = set_peft_model_state_dict(self.peft, tensors, adapter_name=name)
            missing = [k for k in result.missing_keys if f".{name}." in k]
            if missing or result.unexpected_keys:
                self.peft.delete_adapter(name)
                raise ValueError(f"adapter tensors do not match the config: missing {missing[:3]}, "
                                 f"unexpected {result.unexpected_keys[:3]}")

    def unload_adapter(self, body: dict) -> dict:
        with self.lora_update_lock:
            return self._unload_locked(body["lora_name"])

    def _unload_locked(self, name: str) -> dict:
        with self.cond:
            lora_id = self.pending_unloads.get(name) or self.registry.pop(name, None)
            if lora_id is None:
                return {"success": False, "error_message": f"LoRA with name {name} does not exist. Loaded LoRAs: "
                        f"{list(self.registry)}", "loaded_adapters": dict.fromkeys(self.registry, "__tensor__")}
            self.pending_unloads[name] = lora_id
            self.blocked_unloads += self.counters[lora_id] > 0
            self.cond.wait_for(lambda: self.counters[lora_id] == 0)  # SGLang waits with no timeout
            del self.counters[lora_id]
        with self.model_lock, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PEFT warns when the adapter it deletes was the active one
            self.peft.delete_adapter(name)
        self.pending_unloads.pop(name)
        return {"success": True, "error_message": "", "loaded_adapters": dict.fromkeys(self.registry, "__tensor__")}

    @contextlib.contextmanager
    def hold(self, name: str | None):
        """Count a request on adapter `name` for the duration (what an in-flight /generate does)."""
        with self.cond:
            self.cond.wait_for(lambda: self.paused is None)  # a paused server holds new requests
            lora_id = None
            if name is not None:
                if name not in self.registry:
                    raise Refused({"error": {"message": f"The following requested LoRA adapters are not loaded: "
                                             f"{name}\nLoaded adapters: {list(self.registry)}."}})
                self.registry.move_to_end(name)
                lora_id = self.registry[name]
                self.counters[lora_id] += 1
            self.running += 1
        try:
            yield
        finally:
            with self.cond:
                self.running -= 1
                if lora_id is not None:
                    self.counters[lora_id] -= 1
                self.cond.notify_all()

    def generate(self, body: dict) -> dict:
        if body.get("input_ids") is None:
            raise Refused({"error": {"message": "the conformance server has no tokenizer: send input_ids"}})
        params = body.get("sampling_params") or {}
        ids, start = list(body["input_ids"]), body.get("logprob_start_len")
        with self.hold(body.get("lora_path")):
            time.sleep(next(self._delays))
            with self.model_lock, torch.no_grad(), self._adapter(body.get("lora_path")) as model:
                prompt_lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
                lp, out = prompt_lp[-1], []
                for _ in range(params.get("max_new_tokens", 128)):
                    if out:  # no KV cache: recompute the whole sequence (the model is tiny)
                        seq = torch.tensor([ids + [e[1] for e in out]])
                        lp = torch.log_softmax(model(seq).logits[0, -1].float(), -1)
                    tok = int(lp.argmax()) if params.get("temperature", 1.0) == 0 else int(torch.multinomial(lp.exp(), 1))
                    out.append([float(lp[tok]), tok, None])
        inputs = [[None if i == 0 else float(prompt_lp[i - 1, ids[i]]), ids[i], None] for i in range(len(ids))]
        meta = {"id": body.get("rid") or "req", "finish_reason": {"type": "length", "length": len(out)},
                "prompt_tokens": len(ids), "completion_tokens": len(out), "weight_version": self.weight_version}
        if body.get("return_logprob"):
            meta |= {"output_token_logprobs": out, "input_token_logprobs": inputs[start:] if start is not None and start >= 0 else []}
        return {"text": "", "output_ids": [e[1] for e in out], "meta_info": meta}

    @contextlib.contextmanager
    def _adapter(self, name: str | None):
        if self.peft is None:
            yield self.model
        elif name is None:
            with self.peft.disable_adapter():
                yield self.peft
        else:
            self.peft.set_adapter(name)
            yield self.peft

    def pause(self, body: dict) -> dict:
        with self.cond:
            self.paused = body.get("mode", "abort")
        return {"message": "Generation paused successfully.", "status": "ok"}

    def resume(self, body: dict) -> dict:
        with self.cond:
            self.paused = None
            self.cond.notify_all()
        return {"message": "Generation continued successfully.", "status": "ok"}

    def release(self, body: dict) -> None:
        self.released.append(body.get("tags"))


class ConformanceServer:
    """A real HTTP server on 127.0.0.1 playing SGLang 0.5.23; use as a context manager."""

    def __init__(self, model_config: LlamaConfig, **args: Any) -> None:
        self.model_config, self.args = model_config, ServerArgs(**args)
        self.engine = Engine(model_config, self.args, seed=1000)
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._http.daemon_threads = True
        self._http.conformance = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        # A short poll interval: shutdown() waits up to one interval.
        self._thread = threading.Thread(target=self._http.serve_forever, args=(0.02,), daemon=True)

    def __enter__(self) -> ConformanceServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._http.shutdown()
        self._http.server_close()

    def restart(self) -> None:
        """A new incarnation: dummy weights, no adapters, weight_version back to its launch value."""
        self.engine = Engine(self.model_config, self.args, seed=1000 + len(self.engine.calls))

    def server_info(self) -> dict:
        a = self.args
        return {"version": "0.5.23", "enable_lora": a.enable_lora, "max_lora_rank": a.max_lora_rank,
                "lora_target_modules": a.lora_target_modules, "max_loaded_loras": a.max_loaded_loras,
                "max_loras_per_batch": a.max_loras_per_batch, "tp_size": a.tp_size, "dp_size": a.dp_size,
                "weight_version": a.weight_version, "startup_time": {}, "internal_states": []}

    def route(self, method: str, path: str, query: dict, body: Any, auth: str | None) -> tuple[int, Any]:
        """Answer one request as SGLang would: (status, JSON body or text)."""
        if self.args.api_key and not path.startswith("/health") and auth != f"Bearer {self.args.api_key}":
            return 401, {"error": "Unauthorized"}
        e = self.engine
        gets = {"/server_info": self.server_info, "/get_server_info": self.server_info,
                "/model_info": lambda: {"model_path": "conformance", "weight_version": e.weight_version}}
        if method == "GET" and path in gets:
            return 200, gets[path]()
        if path == "/flush_cache":
            deadline = time.monotonic() + float(query.get("timeout", ["0"])[0])
            with e.cond:
                idle = e.cond.wait_for(lambda: e.running == 0, max(deadline - time.monotonic(), 0))
            e.calls.append((path, {"timeout": query.get("timeout", ["0"])[0]}))
            return (200, "Cache flushed.\n") if idle else (400, "Timed out waiting for idle state.")
        posts = {"/begin_weight_update": e.begin, "/end_weight_update": e.end, "/update_weights_from_tensor": e.update_base,
                 "/load_lora_adapter_from_tensors": e.load_adapter, "/unload_lora_adapter": e.unload_adapter,
                 "/pause_generation": e.pause, "/continue_generation": e.resume, "/generate": e.generate,
                 "/release_memory_occupation": e.release, "/resume_memory_occupation": e.release}
        if method != "POST" or path not in posts:
            return 404, {"detail": "Not Found"}
        validate(path, body)
        e.calls.append((path, {k: v for k, v in body.items() if k != "serialized_named_tensors"}))
        out = posts[path](body)
        return (400 if isinstance(out, dict) and out.get("success") is False else 200), out


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _serve(self, method: str) -> None:
        url = urllib.parse.urlsplit(self.path)
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            body = json.loads(raw) if raw else {}
            status, out = self.server.conformance.route(  # type: ignore[attr-defined]
                method, url.path, urllib.parse.parse_qs(url.query), body, self.headers.get("Authorization"))
        except Refused as err:
            status, out = err.status, err.body
        except ValueError as err:
            status, out = 400, {"object": "error", "message": f"invalid JSON: {err}", "code": 400}
        data = out.encode() if isinstance(out, str) else json.dumps(out).encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain" if isinstance(out, str) else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._serve("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._serve("POST")

    def log_message(self, *args: Any) -> None:
        """Quiet: tests read the engine's call log instead."""
