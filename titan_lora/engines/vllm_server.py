"""The vLLM engine process: one vLLM engine, driven by one thread, behind a small JSON-over-HTTP API.

    python -m titan_lora.engines.vllm_server --model DIR --port 8011 [--max-lora-rank 16 ...]

One thread owns the engine and runs `step()`; adapter loads, base updates and unloads run on that
thread *between* steps, so requests in flight (on any version) keep decoding while a new version
loads. By default the engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: 10 s to start
on CPU instead of 65 s); `--multiprocess` keeps vLLM's own process layout.

The environment carries the API key (TITAN_LORA_API_KEY) and the launcher's nonce
(TITAN_LORA_ENGINE_NONCE, echoed by /titan/info). Fault injection for the chaos tests:
TITAN_LORA_FAULT_BUCKET_PAUSE_S=<seconds> pauses inside a bucket (after mapping, before copy-out), once
per removal of the file TITAN_LORA_FAULT_MARKER names (`titan_lora.engines.transfers`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from typing import Any

from titan_lora.engines.http_server import DEFAULT_MAX_BODY_MB, make_handler
from titan_lora.engines.vllm_loop import EngineLoop
from titan_lora.transfer import protocol
from titan_lora.transfer.errors import check_name

logger = logging.getLogger("titan_lora.engine")
EXTENSION = "titan_lora.engines.vllm_ext.TitanLoRAWorkerExtension"
ROUTES = protocol.TRANSFER_ROUTES + protocol.INFERENCE_ROUTES
RELEASE_TIMEOUT_S = 20.0  # below the 30 s a launcher waits after SIGTERM before it kills


class EngineService:
    """The API's behaviour, independent of HTTP: names, ids, leases and the engine loop."""

    def __init__(self, loop: EngineLoop, model: str, request_timeout_s: float = 600.0) -> None:
        self.loop = loop
        self.model = model
        self.request_timeout_s = request_timeout_s
        self.incarnation = uuid.uuid4().hex
        self.nonce = os.environ.get(protocol.NONCE_ENV, "")
        self.base_version: int | None = None
        self.adapters: dict[str, int] = {}  # versioned name -> vLLM int id
        self._next_id = 1
        self._table = threading.Lock()  # guards adapters and _next_id, and pairs a lookup with its lease
        # Fixed at engine start; reading them through the engine thread would wait for a step boundary.
        self.limits = loop.rpc("titan_lora_info")

    def info(self, _: dict) -> dict:
        """Identity, base state, live adapters and LoRA limits (asked before every sync: no engine call)."""
        with self._table:
            adapters = dict(self.adapters)
        return {"incarnation": self.incarnation, "nonce": self.nonce, "model": self.model,
                "base_version": self.base_version, "adapters": adapters, "in_flight": self.loop.in_flight(),
                **self.limits}

    def bucket(self, req: dict) -> dict:
        """Copy one bucket out of shared memory (the ack means the trainer may reuse the buffer); an
        adapter's last bucket carries its commit, saving a round trip."""
        ack = self.loop.rpc("titan_receive_bucket", req["transfer_id"], req["segment"], req["layout"],
                            req.get("header"), req.get("kind", "adapter"), req.get("checksum"))
        if "commit" in req:
            ack["commit"] = self.adapter({**req["commit"], "transfer_id": req["transfer_id"]})
        return ack

    def _new_id(self) -> int:
        """A fresh vLLM int id (the caller holds the table lock)."""
        lora_id, self._next_id = self._next_id, self._next_id + 1
        return lora_id

    def adapter(self, req: dict) -> dict:
        """Install the staged transfer as adapter `name` under a fresh int id."""
        name = check_name(req["name"])
        self._unload_to_replace(name)  # a resumed trainer re-sends its last version
        with self._table:
            lora_id = self._new_id()
        started = time.perf_counter()
        ack = self.loop.rpc("titan_commit_adapter", req["transfer_id"], lora_id, name, req["peft_config"])
        with self._table:
            self.adapters[name] = lora_id
        apply_ms = (time.perf_counter() - started) * 1e3
        return {**ack, "name": name, "version": req["version"], "apply_ms": apply_ms}

    def _unload_to_replace(self, name: str) -> None:
        """Free the id that `name` holds before it gets a new one; refuse while requests still use it
        (overwriting the table entry would leave the old id installed and unreachable)."""
        reply = self.unload({"name": name, "timeout_s": 30})
        if not reply["unloaded"]:
            raise RuntimeError(f"adapter {name!r} cannot be replaced: {reply['in_flight']} requests still "
                               "use it after 30 s; send it under a new versioned name or retry when "
                               "they finish")

    def adapter_from_path(self, req: dict) -> dict:
        """vLLM's own disk path: load a PEFT directory as adapter `name` (the baseline)."""
        from vllm.lora.request import LoRARequest

        name = check_name(req["name"])
        with self._table:
            if name in self.adapters:
                raise ValueError(f"adapter {name!r} is already loaded: unload it first or use a new "
                                 "versioned name")
            lora_id = self._new_id()
        self.loop.call(lambda llm: llm.llm_engine.add_lora(LoRARequest(name, lora_id, req["path"])))
        with self._table:
            self.adapters[name] = lora_id
        return {**_describe_safetensors(os.path.join(req["path"], "adapter_model.safetensors")),
                "name": name, "version": req["version"]}

    def base(self, req: dict) -> dict:
        """Install the staged transfer as the base weights."""
        ack = self.loop.rpc("titan_commit_base", req["transfer_id"])
        self.loop.call(lambda llm: llm.reset_prefix_cache())  # cached KV came from the old weights
        self.base_version = req["version"]
        return {**ack, "version": req["version"]}

    def unload(self, req: dict) -> dict:
        """Remove adapter `name` once no request uses it, waiting at most `timeout_s`."""
        name = req["name"]
        with self._table:
            if name not in self.adapters:
                return {"unloaded": True}
        drained = self.loop.wait_unused(name, float(req.get("timeout_s", 10)))
        with self._table:  # no request can take a lease between this check and the removal
            in_flight = self.loop.in_flight().get(name, 0)
            if not drained or in_flight:
                return {"unloaded": False, "in_flight": in_flight}
            lora_id = self.adapters.pop(name, None)
        if lora_id is not None:
            self.loop.rpc("titan_remove_adapter", lora_id)
        return {"unloaded": True}

    def _lora(self, name: str | None):  # noqa: ANN202
        """The LoRARequest for `name` (the caller holds the table lock)."""
        from vllm.lora.request import LoRARequest

        if name is None:
            return None
        if name not in self.adapters:
            raise KeyError(f"adapter {name!r} is not loaded here; loaded: {sorted(self.adapters)}")
        return LoRARequest(name, self.adapters[name], "titan-mem://" + name)

    @contextlib.contextmanager
    def _leased(self, name: str | None, n: int) -> Iterator[Any]:
        """The LoRARequest for `name`, with `n` requests counted in flight on it until the block ends;
        looked up and counted under the table lock, so an unload cannot remove it in between."""
        with contextlib.ExitStack() as lease:
            with self._table:
                lora = self._lora(name)
                lease.enter_context(self.loop.using(name, n))
            yield lora

    def _deadline(self, req: dict) -> float:
        """When the request's work must be done (`timeout_s` in the body, else the engine's flag)."""
        timeout_s = float(self.request_timeout_s if req.get("timeout_s") is None else req["timeout_s"])
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        return time.monotonic() + timeout_s

    def generate(self, req: dict) -> dict:
        """One completion per token-id prompt under adapter `adapter` (null: the base)."""
        from vllm import SamplingParams

        seed = req.get("seed")
        params = [  # one seed per prompt: a group of identical prompts gets distinct, reproducible samples
            SamplingParams(
                n=1, max_tokens=int(req["max_tokens"]), temperature=float(req.get("temperature", 1.0)),
                seed=None if seed is None else seed + i, logprobs=0, stop_token_ids=req.get("stop_token_ids"),
            )
            for i in range(len(req["prompts"]))
        ]
        name = req.get("adapter")
        deadline = self._deadline(req)
        with self._leased(name, len(req["prompts"])) as lora:
            outs = self.loop.generate(req["prompts"], params, lora, deadline - time.monotonic())
        return {"adapter": name, "outputs": [
            {"token_ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text,
             "logprobs": [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]}
            for o in outs]}

    def score(self, req: dict) -> dict:
        """Log-prob of every token after the first, for each sequence, under adapter `adapter`."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        name = req.get("adapter")
        # One sequence per engine batch: vLLM 0.32's CPU LoRA kernels fail on prompt log-probs of
        # several LoRA sequences batched together (an einsum shape error).
        deadline = self._deadline(req)
        with self._leased(name, len(req["sequences"])) as lora:
            outs = [self.loop.generate([ids], params, lora, max(0.0, deadline - time.monotonic()))[0]
                    for ids in req["sequences"]]
        return {"adapter": name, "logprobs": [
            [o.prompt_logprobs[j][ids[j]].logprob for j in range(1, len(ids))]
            for o, ids in zip(outs, req["sequences"])]}


def _describe_safetensors(path: str) -> dict:
    """Tensor count and bytes of a safetensors file, as the engine read it."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        sizes = [f.get_slice(k).get_shape() for k in f.keys()]
        dtypes = [f.get_slice(k).get_dtype() for k in f.keys()]
    width = {"F32": 4, "BF16": 2, "F16": 2}
    return {"tensors": len(sizes), "bytes": sum(math.prod(s) * width[d] for s, d in zip(sizes, dtypes))}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of the engine process."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--api-key", default=os.environ.get(protocol.API_KEY_ENV, ""),
                   help="for manual use; a launcher passes TITAN_LORA_API_KEY in the environment")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=3)
    p.add_argument("--max-cpu-loras", type=int, default=4)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-cache-gib", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout-s", type=float, default=600.0,
                   help="deadline of a generate/score call whose body has no timeout_s")
    p.add_argument("--max-body-mb", type=int, default=DEFAULT_MAX_BODY_MB,
                   help="largest request body accepted")
    p.add_argument("--multiprocess", action="store_true", help="keep vLLM's engine-core process")
    return p.parse_args(argv)


def build_llm(args: argparse.Namespace):  # noqa: ANN201
    """The vLLM engine with LoRA and titan_lora's worker extension."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.multiprocess else "0"
    from vllm import LLM

    return LLM(
        model=args.model, dtype=args.dtype, enforce_eager=True, seed=args.seed,
        enable_lora=True, max_lora_rank=args.max_lora_rank, max_loras=args.max_loras,
        max_cpu_loras=max(args.max_cpu_loras, args.max_loras), max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, worker_extension_cls=EXTENSION,
    )


def release_and_stop(loop: EngineLoop, incarnation: str) -> None:
    """Unmap every trainer buffer in every worker, then stop the engine thread."""
    try:
        # a trainer's CUDA IPC ref-counter file goes only once every mapping of its buffer is gone
        held = loop.rpc("titan_release_buffers", timeout_s=RELEASE_TIMEOUT_S)
    finally:
        loop.stop()
    logger.info("engine %s stopped; %d mappings released", incarnation[:8], held)


def main(argv: list[str] | None = None) -> None:
    """Start the engine, warm it up, then serve until SIGTERM (or Ctrl-C), releasing its mappings."""
    logging.basicConfig(level=logging.INFO, format="[titan_lora engine %(asctime)s] %(message)s",
                        datefmt="%H:%M:%S")
    args = parse_args(argv)
    started = time.perf_counter()
    loop = EngineLoop(build_llm(args))
    loop.warm_up()
    service = EngineService(loop, args.model, args.request_timeout_s)
    routes = {op: getattr(service, op) for op in ROUTES}
    handler = make_handler(routes, args.api_key, args.max_body_mb * 2**20)
    server = ThreadingHTTPServer((args.host, args.port), handler)
    logger.info("engine %s ready on http://%s:%d in %.1f s", service.incarnation[:8], args.host,
                args.port, time.perf_counter() - started)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # unwind, so the finally below runs
    try:
        server.serve_forever()
    finally:
        server.server_close()
        release_and_stop(loop, service.incarnation)


if __name__ == "__main__":
    main()
