"""Several adapters' sync: K adapters gathered together and sent in one bucket stream (what a job with K
`[[adapters]]` does after every step) against K one-adapter syncs one after the other (K one-adapter jobs on
one engine), beside the floor (a memory copy of the K adapters' bytes), as ratios.

    python scripts/bench_multi_sync.py [--ks 1 2 4 8] [--iters 10] [--rank 16]

SmolLM2-135M shapes (random base: only the shapes matter), LoRA r16 on all linears per adapter, fp32, one
trainer process, shared memory, the receiver process (the engine side of a transfer with no inference: its
copy-out and checksum are vLLM's). Each sync: gather (the snapshot) + checksum + post + copy-out + ack.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_timing import alternating, p, timed

from titan_lora.lora.layer import adapter_params
from titan_lora.titan.lora_linear import fill_param
from titan_lora.trainer.build import build_from_toml
from titan_lora.trainer.job_config import job_config_from_toml

TOML = """
[model]
name = "smollm2"
flavor = "135M"
load_pretrained = false
converters = ["lora"]
[lora]
rank = {rank}
alpha = {alpha}
target_modules = "all-linear"
[training]
mixed_precision_param = "float32"
[activation_checkpoint]
mode = "none"
"""


def job_text(k: int, rank: int) -> str:
    """A job with `k` adapter tables (none for k = 1: the one-adapter job)."""
    tables = "".join(f'[[adapters]]\nname = "a{i}"\n' for i in range(k)) if k > 1 else ""
    return TOML.format(rank=rank, alpha=2 * rank) + tables


def randomize(model: torch.nn.Module) -> None:
    """Non-zero adapters (the sync moves real values)."""
    with torch.no_grad():
        for i, (_, param) in enumerate(adapter_params(model)):
            fill_param(param, torch.randn(param.shape, generator=torch.Generator().manual_seed(i)) * 0.01)


def sync_fn(text: str, emitter, version_names: list[str]) -> tuple[Callable[[], None], int]:  # noqa: ANN001
    """(sync, bytes): one sync of the job's adapters (gather + one transfer), recording each version's name."""
    from titan_lora.clients.base import AdapterSet, send_adapter_set
    from titan_lora.config_adapters import adapter_lora, job_adapters
    from titan_lora.sync.adapter_set import AdapterSetSource
    from titan_lora.sync.adapter_source import AdapterSource

    built = build_from_toml(text, device=torch.device("cpu"))
    randomize(built.model)
    job = job_config_from_toml(text)
    if job.adapters:
        source = AdapterSetSource(built.model, built.peft_layout,
                                  [(a.name, adapter_lora(a, job.lora)) for a in job_adapters(job)],
                                  lend=emitter.lend_buffer)
    else:
        source = AdapterSource(built.model, built.peft_layout, job.lora, f"solo{id(emitter) % 997}",
                               lend=emitter.lend_buffer)
    versions = iter(range(1, 1_000_000))

    def sync() -> None:
        adapters = AdapterSet.of(source.snapshot(next(versions)))
        send_adapter_set(emitter, adapters)
        version_names.extend(part.name for part in adapters.parts)

    return sync, source.gatherer.nbytes


def main() -> None:
    """Time each K against K one-adapter syncs and the floor; print one table."""
    from titan_lora.clients.http import JsonClient
    from titan_lora.clients.launch import EmbeddedEngine, free_port
    from titan_lora.clients.vllm import VLLMBucketEmitter, receiver_plan
    from titan_lora.config import WeightSync

    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    args.add_argument("--iters", type=int, default=10)
    args.add_argument("--rank", type=int, default=16)
    opts = args.parse_args()
    slots = 4 * max(opts.ks) + 4
    engine = EmbeddedEngine(receiver_plan(torch.device("cpu"), slots), free_port(),
                            os.path.join(tempfile.gettempdir(), "titan_lora_bench_multi_sync.log"))
    engine.start()
    try:
        emitters = [VLLMBucketEmitter(JsonClient(engine.url, engine.key), WeightSync.bucket_mb) for _ in range(2)]
        live: list[str] = []

        def retire() -> None:  # off the timed path, as the syncer's retirer: keep the newest few versions
            while len(live) > 2 * max(opts.ks):
                emitters[0].retire_adapter(live.pop(0), timeout_s=30)

        one, one_bytes = sync_fn(job_text(1, opts.rank), emitters[1], live)
        print(f"one adapter: {one_bytes / 2**20:.1f} MiB (SmolLM2-135M shapes, r{opts.rank} all-linear, fp32); "
              f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores")
        print(f"\n{'K':>3s} {'MiB':>7s} {'together ms':>12s} {'p99':>8s} {'one ms':>8s} {'K x one ms':>11s} "
              f"{'floor ms':>9s} {'/ one':>7s} {'/ K x one':>10s} {'x floor':>8s}")
        for k in opts.ks:
            if k == 1:  # the reference: one adapter's sync, which both other columns are
                t_together = t_one = t_sequential = timed(one, opts.iters, between=retire)
                nbytes = one_bytes
            else:
                together, nbytes = sync_fn(job_text(k, opts.rank), emitters[0], live)

                def sequential(k: int = k) -> None:
                    for _ in range(k):
                        one()

                t_together, t_one, t_sequential = alternating([together, one, sequential], opts.iters,
                                                              between=retire)
            src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
            floor = statistics.median(timed(lambda: dst.copy_(src), 20))
            med, med_one, med_seq = (statistics.median(t) for t in (t_together, t_one, t_sequential))
            print(f"{k:3d} {nbytes / 2**20:7.1f} {med:12.2f} {p(t_together, 0.99):8.2f} {med_one:8.2f} "
                  f"{med_seq:11.2f} {floor:9.2f} {med / med_one:6.2f}x {med / med_seq:9.2f}x {med / floor:8.1f}")
        print("\ntogether: one gather of the K adapters + one bucket stream whose commit installs them all;\n"
              "one: one adapter's sync, K x one: K of them in a row (K one-adapter jobs on one engine), both timed\n"
              "in the same round as `together`; floor: a memory copy of the K adapters' bytes.")
        for emitter in emitters:
            emitter.close()
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
