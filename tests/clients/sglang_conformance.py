"""A conformance server that plays SGLang 0.5.23's HTTP surface, for CPU tests of the SGLang emitter.

Written from SGLang's source, independently of the client under test. It checks bodies against the 0.5.23
structs, decodes payloads under SGLang's SafeUnpickler allow-list, applies the base to a HF LlamaForCausalLM
and adapters through PEFT (scale lora_alpha / r: SGLang ignores use_rslora) and serves /generate. Loads and
unloads share one lock, and an unload waits for the adapter's in-flight requests: it blocks later loads too.
Like SGLang it ignores unknown top-level fields (it records them in `Engine.ignored`), and a control
request that raises inside SGLang's scheduler ends the server here too (`EngineCrash`): the connection drops
and the port closes. It is stricter than SGLang where a lax server would hide a client bug: it refuses an
adapter load before the base (a server started with dummy weights would serve garbage) and, as a remote host,
shared-memory tensor handles (an engine on another host could not open them).

The request schemas and their validation, the payload decoding and the server flags live in
sglang_schemas.py; the names other tests import from this module are re-exported here.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import json
import math
import threading
import time
import urllib.parse
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from sglang_generate import REQ_FIELDS, answer, complete, contract_error, normalize
from sglang_schemas import ADMIN_OPTIONAL, SCHEMAS, RefusedError, ServerArgs, decode_tensors, validate
from transformers import LlamaConfig, LlamaForCausalLM

__all__ = ["SCHEMAS", "ConformanceServer", "Engine", "EngineCrash", "RefusedError", "ServerArgs",
           "decode_tensors", "validate"]


# The GenerateReqInput fields the conformance /generate models; others with a value are refused.
_GENERATE_MODELLED = frozenset({"rid", "text", "input_ids", "sampling_params", "lora_path", "return_logprob",
                                "logprob_start_len", "http_worker_ipc"})


class EngineCrash(Exception):
    """An exception inside SGLang's scheduler: the server shuts down (scheduler.py runs control requests
    with no error catching)."""


# ---- the engine ------------------------------------------------------------------------------------

_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj"}


def _normalized(targets: Any) -> set[str]:
    """sglang/srt/lora/utils.py get_normalized_target_modules: fused names, "all" for the shorthand."""
    return {"all"} if isinstance(targets, str) or "all" in targets else {_FUSED.get(t, t) for t in targets}


class Engine:
    """One engine incarnation: weights, adapters, LoRA registry, request counters and a call log."""

    def __init__(self, model_config: LlamaConfig, args: ServerArgs, seed: int) -> None:
        torch.manual_seed(seed)  # dummy weights, unlike the trainer's: the base must be sent
        self.args, self.model = args, LlamaForCausalLM(model_config).eval()
        self.params = self.model.state_dict()  # aliases the live parameters, also once PEFT wraps them
        self.base_missing = {n for n, _ in self.model.named_parameters()}
        self.peft: Any = None
        self.weight_version, self.session_open, self.paused = args.weight_version, False, None
        self.registry: collections.OrderedDict[str, str] = collections.OrderedDict()  # name -> id, LRU
        self.counters: dict[str, int] = {}  # lora id -> in-flight requests
        self.pending_unloads: dict[str, str] = {}  # name -> lora id of an unload still waiting
        self.cond = threading.Condition()
        self.lora_update_lock, self.model_lock = threading.Lock(), threading.Lock()
        self.calls: list[tuple[str, dict]] = []  # (path, body without tensors), in arrival order
        self.released: list[list[str] | None] = []  # tags of memory release/resume calls that freed memory
        self.offloaded: set[str] = set()  # tags released and not yet resumed
        self.ignored: list[str] = []  # "path:field" of unknown fields SGLang would ignore
        self.skipped: list[str] = []  # base names the loader skipped (Llama's load_weights, silently)
        self.ever_loaded: set[str] = set()  # names a /generate would try to reload implicitly
        self.unfused: set[str] = set()  # adapters whose q/k/v or gate/up could not be stacked
        self.incomplete: set[str] = set()  # names parked by a load that failed on some TP ranks
        self.running = self.loaded_high_water = self.lru_evictions = self.blocked_unloads = 0
        self._delays = itertools.cycle(args.gen_delays_s)

    def _decode(self, body: dict) -> dict[str, torch.Tensor]:
        try:
            return decode_tensors(body["serialized_named_tensors"], self.args.tp_size,
                                  body.get("load_format"), self.args.remote)
        except Exception as err:  # raised inside the scheduler: the server dies
            raise EngineCrash(f"cannot decode tensors: {err}") from err

    def _lora(self, error: str = "") -> dict:
        """A LoRAUpdateOutput: success unless `error`, with the adapters loaded now."""
        loaded = dict.fromkeys(self.registry, "__tensor__")
        return {"success": not error, "error_message": error, "loaded_adapters": loaded}

    def session(self, opening: bool) -> dict:
        """/begin_weight_update (opening) and /end_weight_update."""
        if self.session_open == opening:
            return {"success": False, "message": "a weight-update session is already open; call "
                    "end_weight_update() first" if opening else "no weight-update session is open; call "
                    "begin_weight_update() first"}
        self.session_open = opening
        return {"success": True, "message": "Success"}

    def update_base(self, body: dict) -> dict:
        if not self.session_open:
            return {"success": False, "message": "update_weights_from_tensor must run between "
                    "begin_weight_update() and end_weight_update()"}
        tensors = self._decode(body)
        # Llama's load_weights skips a name it does not know (llama.py:759, :779): nothing fails.
        self.skipped += [n for n in tensors if n not in self.params]
        tensors = {n: t for n, t in tensors.items() if n in self.params}
        bad = [(n, tuple(t.shape)) for n, t in tensors.items() if t.shape != self.params[n].shape]
        if bad:  # the weight loader's copy raises inside the scheduler
            raise EngineCrash(f"shape mismatch in load_weights: {bad[:3]}")
        with self.model_lock, torch.no_grad():
            for name, t in tensors.items():
                self.params[name].copy_(t)
                self.base_missing.discard(name)
        if body.get("flush_cache", True) and self.running and self.paused not in ("abort", "retract"):
            return {"success": False, "message": "Weights were updated, but the cache was not flushed "
                    "because requests are still running or queued. Retract or finish them, then call "
                    "/flush_cache."}
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return {"success": True, "message": "Success"}

    def load_adapter(self, body: dict) -> dict:
        name, cfg = body["lora_name"], body["config_dict"]
        if not self.args.enable_lora:
            return self._lora("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        tensors, expected = self._decode(body), body.get("expected_checksums")
        if expected is not None:
            got = {n: hashlib.sha256(t.contiguous().flatten().view(torch.uint8).numpy()).hexdigest()
                   for n, t in tensors.items()}
            if got != expected:  # a RuntimeError in tp_worker.py: the server dies
                raise EngineCrash(f"[LORA-CHECK] rank0 adapter sync MISMATCH of {len(expected)} expected")
        if str(cfg.get("peft_type", "")).lower() != "lora":  # an assert in LoRAAdapter.__init__ (lora.py)
            raise EngineCrash(f"AssertionError: peft_type {cfg.get('peft_type')!r} is not lora")
        with self.lora_update_lock:
            if self.args.enable_dp_attention and self.args.dp_size > 1 and not body.get("pinned"):
                return self._lora("With DP attention, only pinned LoRA adapters can be loaded (lora_manager.py)")
            if name in self.incomplete:
                return self._lora(f"LoRA adapter {name} has an incomplete unload; unload it before loading "
                                  "it again")
            if self.args.partial_load_failures and self.args.tp_size > 1:
                self.args.partial_load_failures -= 1
                self.incomplete.add(name)  # rank 0 loaded it, rank 1 did not
                return self._lora(f"Failed to load LoRA adapter {name} on tp rank 1")
            modules = {m for n in tensors if (m := n.split(".lora_")[0].rsplit(".", 1)[-1])}
            qkv = modules & {"q_proj", "k_proj", "v_proj"}
            if "q_proj" in qkv and "v_proj" not in qkv:  # normalize_qkv_proj indexes v_proj: a bare KeyError
                missing = next(n for n in tensors if ".q_proj." in n).replace("q_proj", "v_proj")
                return self._lora(repr(KeyError(missing)))
            served = _normalized(self.args.lora_target_modules or [])
            fits = _normalized(cfg["target_modules"]) <= served or "all" in served
            if self.base_missing:
                return self._lora(f"conformance: the base weights were never loaded into this engine (e.g. "
                                  f"{sorted(self.base_missing)[0]}); call /update_weights_from_tensor first")
            if cfg["r"] > self.args.max_lora_rank or not fits:
                return self._lora(
                    f"LoRA adapter {name} with rank {cfg['r']} is incompatible with the current LoRA memory "
                    "pool configuration. Please ensure that the LoRA adapter's rank is within the configured "
                    "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`.")
            if name in self.registry:
                return self._lora(f"Failed to load LoRA adapter {name} because it is already loaded")
            try:
                self._install(name, cfg, tensors)
            except ValueError as err:
                return self._lora(str(err))
            if (qkv and "q_proj" not in qkv) or ("up_proj" in modules and "gate_proj" not in modules):
                self.unfused.add(name)  # never stacked: loads fine, fails in the first forward that uses it
            with self.cond:
                self.ever_loaded.add(name)
                self.registry[name] = lora_id = f"{name}#{time.monotonic_ns()}"
                self.counters[lora_id] = 0
                self.loaded_high_water = max(self.loaded_high_water, len(self.registry))
            while self.args.max_loaded_loras is not None and len(self.registry) > self.args.max_loaded_loras:
                self.lru_evictions += 1
                self._unload_locked(next(iter(self.registry)))
        return self._lora()

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
        if name in self.incomplete:  # the unload finishes what the failed load left on rank 0
            self.incomplete.discard(name)
            return self._lora()
        with self.cond:
            lora_id = self.pending_unloads.get(name) or self.registry.pop(name, None)
            if lora_id is None:
                return self._lora(f"LoRA with name {name} does not exist. "
                                  f"Loaded LoRAs: {list(self.registry)}")
            self.pending_unloads[name] = lora_id
            self.blocked_unloads += self.counters[lora_id] > 0
            self.cond.wait_for(lambda: self.counters[lora_id] == 0)  # SGLang waits with no timeout
            del self.counters[lora_id]
        with self.model_lock, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PEFT warns when the adapter it deletes was the active one
            self.peft.delete_adapter(name)
        self.pending_unloads.pop(name)
        return self._lora()

    @contextlib.contextmanager
    def hold(self, names: str | list[str | None] | None):
        """Count one request per entry of `names` (one name: one request) on its adapter while inside (an
        in-flight /generate); a batch's names are resolved together first, as _resolve_lora_path does."""
        names = names if isinstance(names, list) else [names]
        loras = sorted({n for n in names if n is not None})
        with self.cond:
            self.cond.wait_for(lambda: self.paused is None)  # a paused server holds new requests
            if loras and not self.args.enable_lora:
                raise RefusedError({"error": {"message": f"LoRA adapter '{loras[0]}' was requested, but LoRA is "
                                              "not enabled. Please launch the server with --enable-lora flag and "
                                              "preload adapters using --lora-paths or /load_lora_adapter "
                                              "endpoint."}})
            for name in (n for n in loras if n not in self.registry):
                if name not in self.ever_loaded:
                    raise RefusedError({"error": {"message": "Got LoRA adapter that has never been loaded: "
                                                  f"{name}\nAll loaded adapters: {sorted(self.ever_loaded)}."}})
                # tokenizer_manager reloads a known name from its path, "__tensor__" here: a blocking hub
                # download from the scheduler before it fails.
                self.cond.wait(self.args.reload_stall_s)
                raise RefusedError({"error": {"message": f"Failed to implicitly load LoRA adapter {name}: "
                                              "Repository Not Found for url: .../__tensor__"}})
            ids = [None if n is None else self.registry[n] for n in names]
            for name in loras:
                self.registry.move_to_end(name)
            for lora_id in ids:
                if lora_id is not None:
                    self.counters[lora_id] += 1
            self.running += len(names)
        try:
            yield
        finally:
            with self.cond:
                self.running -= len(names)
                for lora_id in ids:
                    if lora_id is not None:
                        self.counters[lora_id] -= 1
                self.cond.notify_all()

    def generate(self, body: dict) -> dict | list[dict]:
        """/generate (sglang_generate.py): one answer, or a list of them in order for a batch."""
        items, single = normalize(body, _GENERATE_MODELLED)
        eos = self.model.config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        answers = []
        with self.hold([item.lora_path for item in items]):
            for name in {item.lora_path for item in items} & self.unfused:  # lora.py / utils.py
                raise EngineCrash(f"KeyError in the LoRA forward of {name}: q/k/v or gate/up were never stacked")
            time.sleep(next(self._delays))
            for n, item in enumerate(items):
                with self.model_lock, self._adapter(item.lora_path) as model:
                    inputs, out, finish = complete(model, item, eos, self.args.enable_deterministic_inference)
                rid = f"{body.get('rid') or 'req'}_{n}" if not single else body.get("rid") or "req"
                answers.append(answer(item, inputs, out, finish, rid, self.weight_version, self.args.detokenize))
        return answers[0] if single else answers

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

    def memory(self, release: bool, body: dict) -> dict:
        """/release_memory_occupation and /resume_memory_occupation (weight_updater.py:339-366)."""
        tags = set(body.get("tags") or ["kv_cache", "weights", "cuda_graph"])
        if release and self.running:
            raise EngineCrash("AssertionError: release_memory_occupation should be called only when server "
                              "is idle.")
        if not release and not tags <= self.offloaded:
            raise EngineCrash(f"resume of {sorted(tags - self.offloaded)}, which were never released")
        self.offloaded = self.offloaded | tags if release else self.offloaded - tags
        if self.args.enable_memory_saver:  # without the memory saver, nothing is freed or re-allocated
            self.released.append(body.get("tags"))
        return {"success": True, "message": "Success"}

    def weights_by_name(self, body: dict) -> Any:
        """/get_weights_by_name: the first rows as float lists; None (an error) for an unknown name."""
        param = self.params.get(body["name"])
        if param is None:
            return None
        return param.detach().float()[:body.get("truncate_size", 100)].tolist()

    def pause(self, mode: str | None) -> dict:
        """/pause_generation (a mode) and /continue_generation (None); paused, new requests wait."""
        with self.cond:
            self.paused = mode
            self.cond.notify_all()
        return {"message": f"Generation {'paused' if mode else 'continued'} successfully.", "status": "ok"}



class ConformanceServer:
    """A real HTTP server on 127.0.0.1 playing SGLang 0.5.23; use it as a context manager."""

    def __init__(self, model_config: LlamaConfig, **args: Any) -> None:
        self.model_config, self.args = model_config, ServerArgs(**args)
        self.engine = Engine(model_config, self.args, seed=1000)
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._http.daemon_threads = True
        self._http.conformance = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self.dead: str | None = None  # why the server died (an exception in a control request)
        # A short poll interval: shutdown() waits up to one interval.
        self._thread = threading.Thread(target=self._http.serve_forever, args=(0.02,), daemon=True)

    def __enter__(self) -> ConformanceServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.dead is None:
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
                "enable_dp_attention": a.enable_dp_attention, "enable_memory_saver": a.enable_memory_saver,
                "device": "cpu", "enable_deterministic_inference": a.enable_deterministic_inference,
                "weight_version": a.weight_version, "startup_time": {}, "internal_states": []}

    def _auth(self, path: str, auth: str | None) -> int:
        """0, or the status utils/auth.py answers (auth.py:127-150): admin-optional routes take only the
        admin key when one is set, every other route only the API key."""
        if path.startswith(("/health", "/ready", "/metrics")):
            return 0
        admin, key = self.args.admin_api_key, self.args.api_key
        want = (admin or key) if path in ADMIN_OPTIONAL else key
        return 401 if want and auth != f"Bearer {want}" else 0

    def route(self, method: str, path: str, query: dict, body: Any, auth: str | None) -> tuple[int, Any]:
        """Answer one request as SGLang would: (status, JSON-able body or text)."""
        denied = self._auth(path, auth)
        if denied:
            return denied, {"error": "Unauthorized" if denied == 401 else "Forbidden"}
        e = self.engine
        gets = {"/server_info": self.server_info, "/get_server_info": self.server_info,
                "/model_info": lambda: {"model_path": "conformance", "weight_version": e.weight_version}}
        if method == "GET" and path in gets:
            return 200, gets[path]()
        if path == "/flush_cache":  # flush once idle, waiting up to ?timeout= seconds
            e.calls.append((path, {"timeout": query.get("timeout", ["0"])[0]}))
            with e.cond:
                idle = e.cond.wait_for(lambda: e.running == 0, float(query.get("timeout", ["0"])[0]))
            return (200, "Cache flushed.\n") if idle else (400, "Timed out waiting for idle state.")
        posts = {"/update_weights_from_tensor": e.update_base, "/unload_lora_adapter": e.unload_adapter,
                 "/load_lora_adapter_from_tensors": e.load_adapter, "/generate": e.generate,
                 "/begin_weight_update": lambda b: e.session(True),
                 "/end_weight_update": lambda b: e.session(False),
                 "/pause_generation": lambda b: e.pause(b.get("mode", "abort")),
                 "/continue_generation": lambda b: e.pause(None),
                 "/release_memory_occupation": lambda b: e.memory(True, b),
                 "/resume_memory_occupation": lambda b: e.memory(False, b),
                 "/get_weights_by_name": e.weights_by_name}
        if method != "POST" or path not in posts:
            return 404, {"detail": "Not Found"}
        if path == "/generate":  # http_server.py: FastAPI drops unknown fields, then the api/v1 contract
            e.ignored += [f"{path}:{k}" for k in (body if isinstance(body, dict) else {}) if k not in REQ_FIELDS]
            if (error := contract_error(body)) is not None:
                return 400, {"error": error}
        else:
            validate(path, body, e.ignored)
        e.calls.append((path, {k: v for k, v in body.items() if k != "serialized_named_tensors"}))
        out = posts[path](body)
        if out is None:
            return 400, {"object": "error", "message": "Get parameter by name failed", "code": 400}
        return (400 if isinstance(out, dict) and out.get("success") is False else 200), out

    def die(self, reason: str) -> None:
        """The scheduler raised: SGLang's process ends, so the port closes and nothing answers again."""
        self.dead = reason
        self._http.shutdown()  # handlers run on their own threads, so this cannot wait on itself
        self._http.socket.close()


def _finite(value: Any) -> Any:
    """`value` with every non-finite float replaced by None, as orjson serializes it."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _serve(self, method: str) -> None:
        url = urllib.parse.urlsplit(self.path)
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            body = json.loads(raw) if raw else {}
            status, out = self.server.conformance.route(  # type: ignore[attr-defined]
                method, url.path, urllib.parse.parse_qs(url.query), body, self.headers.get("Authorization"))
        except RefusedError as err:
            status, out = err.status, err.body
        except EngineCrash as err:  # the request gets no answer, and the server goes away
            self.close_connection = True
            self.server.conformance.die(str(err))  # type: ignore[attr-defined]
            return
        except json.JSONDecodeError as err:
            status, out = 400, {"object": "error", "message": f"invalid JSON: {err}", "code": 400}
        # orjson, which SGLang answers with, writes a non-finite float as null.
        data = out.encode() if isinstance(out, str) else json.dumps(_finite(out)).encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain" if isinstance(out, str) else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        with contextlib.suppress(ConnectionError):  # the client timed out and left; drop the answer
            self.wfile.write(data)

    def do_GET(self) -> None:  # http.server's naming
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def log_message(self, *args: Any) -> None:
        """Quiet: tests read the engine's call log instead."""
