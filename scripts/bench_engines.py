"""Engine kinds side by side, in one run: by default the bucket path (`vllm`) against the disk baseline
(`vllm-disk`), both on vLLM's OpenAI server with titan's routes. CPU, SmolLM2-135M + LoRA r16 all-linear.
(It compared titan_lora's earlier standalone server with this engine until that server was removed; the
figures are kept in docs/benchmarks.md.)

    python scripts/bench_engines.py [--iters 20] [--kinds vllm,vllm-disk]

Per kind, one engine after the other (2 cores: side by side they would share them): start time (spawn
to the first `/titan/info` with our nonce), the base send, adapter syncs (the bucket emitter's
send_adapter with its ack, the gather excluded; the two newest versions kept live, as in training) and
rollout throughput (64 samples of 8 new tokens at T=1 under the newest adapter, the GRPO default).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_sync import CPU_TOML, p, randomize

from titan_lora.clients.base import Endpoint
from titan_lora.clients.kinds import LaunchRequest, engine_kind
from titan_lora.clients.launch import EmbeddedEngine, free_port
from titan_lora.config import Engine, WeightSync
from titan_lora.sync.adapter_source import AdapterSource
from titan_lora.sync.base_stream import base_weights_source
from titan_lora.trainer.build import build_from_toml
from titan_lora.trainer.job_config import job_config_from_toml

CPU = torch.device("cpu")


def bench_kind(kind_name: str, built, source: AdapterSource, iters: int, prompts: list[list[int]]) -> dict:  # noqa: ANN001
    """Start, base, syncs and rollouts against one engine of `kind_name`."""
    kind, ws = engine_kind(kind_name), WeightSync(enabled=True)
    plan = kind.launch(LaunchRequest(Engine(), ws.keep_versions, built.hf_dir, CPU, 16))
    log = os.path.join(tempfile.gettempdir(), f"titan_lora_bench_{kind_name.replace(':', '_')}.log")
    engine = EmbeddedEngine(plan, free_port(), log)
    t0 = time.perf_counter()
    engine.start()
    figures = {"start_s": time.perf_counter() - t0}
    endpoint = Endpoint(engine.url, engine.key)
    emitter, rollouts = kind.emitter(ws, Engine(kind=kind_name), endpoint), kind.rollouts(endpoint, ws)
    try:
        t0 = time.perf_counter()
        emitter.send_base(base_weights_source(built.model, built.sd_adapter, tied_embeddings=True)(), 0)
        figures["base_s"] = time.perf_counter() - t0
        live, sync_ms, apply_ms = [], [], []
        for version in range(1, iters + 3):
            payload = source.snapshot(version)
            t0 = time.perf_counter()
            ack = emitter.send_adapter(payload)
            if version > 2:  # two warm-up syncs
                sync_ms.append((time.perf_counter() - t0) * 1e3)
                apply_ms.append(ack.phases_ms["apply_ms"])
            live.append(payload.name)
            while len(live) > ws.keep_versions:
                emitter.retire_adapter(live.pop(0), timeout_s=30)
        figures |= {"sync_p50_ms": statistics.median(sync_ms), "sync_p99_ms": p(sync_ms, 0.99),
                    "apply_p50_ms": statistics.median(apply_ms)}
        rollouts.generate(prompts[:8], live[-1], 8, 1.0, 0, [])  # warm-up
        t0 = time.perf_counter()
        out = rollouts.generate(prompts, live[-1], 8, 1.0, 1, [])
        figures["rollout_tok_s"] = sum(len(c.token_ids) for c in out) / (time.perf_counter() - t0)
    finally:
        emitter.close()
        engine.stop()
    return figures


def main() -> None:
    """Print one row of figures per engine kind."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--kinds", default="vllm,vllm-disk")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from titan_lora.rl.task import task_prompt
    from titan_lora.rl.tasks import ArithTask

    built = build_from_toml(CPU_TOML, device=CPU)
    randomize(built.model)
    kinds = args.kinds.split(",")
    emitter_lend = engine_kind(kinds[0]).emitter(WeightSync(), Engine(), Endpoint("http://127.0.0.1:1")).lend_buffer
    source = AdapterSource(built.model, built.peft_layout, job_config_from_toml(CPU_TOML).lora, lend=emitter_lend)
    tok = AutoTokenizer.from_pretrained(built.hf_dir)
    questions = [f"What is {a} + {b}?" for a, b in zip(range(1, 9), range(9, 1, -1))]
    prompts = [tok(task_prompt(tok, ArithTask(), q), add_special_tokens=False)["input_ids"]
               for q in questions for _ in range(8)]  # 8 prompts x 8 samples
    rows = {kind: bench_kind(kind, built, source, args.iters, prompts) for kind in kinds}
    keys = list(next(iter(rows.values())))
    print(f"\n{'kind':32s}" + "".join(f"{k:>15s}" for k in keys))
    for kind, figures in rows.items():
        print(f"{kind:32s}" + "".join(f"{figures[k]:15.2f}" for k in keys))


if __name__ == "__main__":
    main()
