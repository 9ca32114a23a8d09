"""Training-step benchmark: titan_lora's LoRA step vs full fine-tuning at one shape, in one run.

GPU (one process per GPU; 8B full fine-tuning needs ~16 bytes a param, so one 80 GB GPU takes ~8 layers):
    torchrun --nproc_per_node=1 scripts/bench_step.py --layers 8 [--steps 20] [--profile]
    torchrun --nproc_per_node=2 scripts/bench_step.py            (all 32 layers, FSDP over 2 GPUs)
    torchrun --nproc_per_node=4 scripts/bench_step.py --tp 2     (TP=2 x FSDP=2)
    add --compile to compile each block ([compile] enable = true) in all three variants,
    --phases to time forward, backward, clip and optimizer of the LoRA and full steps apart
    --model qwen3_moe --flavor 30B-A3B --layers 4: Qwen3-30B-A3B's shape, LoRA on attention and every expert
    --adapters 2 4 8: also K adapters ([[adapters]] tables) in one step of K x batch rows, each adapter its own
        rows, against K one-adapter steps one after the other (the replicated LoRA variant, K times)
CPU smoke test:
    python scripts/bench_step.py --device cpu --flavor debugmodel --seq-len 64 --steps 2
    python scripts/bench_step.py --device cpu --model qwen3_moe --flavor debugmodel_moe --seq-len 64 --steps 2

Four variants, built one after another through titan_lora's own path (`job_from_toml`, `build_model`),
same shape, same random token batch, bf16 params through titan_lora's FSDP2 (a 1-rank mesh on one GPU,
so the mixed precision and the FSDP hooks are those of a multi-GPU run), fp32 master weights:
- floor: the frozen base model (no adapters), forward + backward to the input (every linear's input
  gradient, no weight gradient), no optimizer: the compute a LoRA step cannot avoid;
- LoRA, adapters sharded by FSDP: `converters = ["lora"]`, r16 alpha 32 on all linears, bf16 adapters,
  `[lora] replicate_adapters = false`;
- LoRA, adapters replicated: the same with `replicate_adapters = true` (the default);
- full: no converter, every param trained;
- with `--adapters K`: K replicated adapters of the same shape in one job, one step of K x batch rows (each
  adapter its own `batch` rows: the base runs once for all of them), clipped per adapter as
  `TrainingRun.train_step` does.
A LoRA or full step is what `TrainingRun.train_step` does: zero_grad, forward, the train spec's loss,
backward, clip_grad_norm_ (foreach), the train spec's optimizer step (torchtitan's AdamW).
Step times are the slowest rank's, with the device synchronised; peak memory is the largest rank's
`torch.cuda.max_memory_allocated` over the timed steps.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_lora.config_adapters import job_adapters
from titan_lora.lora.multi_optim import adapter_optimizer_groups, clip_per_adapter
from titan_lora.lora.multi_rows import AdapterRows, routed
from titan_lora.lora.parallelize import shard_model
from titan_lora.lora.replicated import one_sum_for_the_step
from titan_lora.titan.optim import build_loss, build_optimizers, clip_grad_norm_
from titan_lora.titan.parallel import build_parallel_dims
from titan_lora.trainer.build import build_model
from titan_lora.trainer.distributed import device_for_rank, init_distributed
from titan_lora.trainer.job_config import job_from_toml

# The step probe the goal was set from (docs/benchmarks-log.md, 2026-11-29): 2 x H200, Llama-3-8B (32 layers),
# seq 2048, batch 1 per GPU.
BASELINE = "LoRA 0.266 s vs full 0.310 s = 0.86x; peak 29.9 vs 78.4 GiB (2 x H200, 8B, 32 layers, 2026-11-29)"
TARGET = 0.70
VARIANTS = {
    "floor": "floor: frozen base fwd+bwd, no optimizer",
    "lora": "LoRA step (adapters sharded by FSDP)",
    "lora_replicated": "LoRA step (adapters replicated)",
    "full": "full fine-tuning step",
}
LORA_VARIANTS = ("lora", "lora_replicated")
MULTI_PREFIX = "lora_x"  # + K: K adapters in one step


def adapters_of(variant: str) -> int:
    """How many adapters `variant` trains in one step (0: none, the floor and full; 1: the LoRA variants)."""
    if variant.startswith(MULTI_PREFIX):
        return int(variant[len(MULTI_PREFIX):])
    return 1 if variant in LORA_VARIANTS else 0


def describe(variant: str) -> str:
    """The table's name for `variant`."""
    k = adapters_of(variant)
    return f"{k} adapters in one step ({k} x batch rows)" if variant.startswith(MULTI_PREFIX) else VARIANTS[variant]


@dataclasses.dataclass
class Result:
    """One variant's figures (times in s, slowest rank per step; memory in GiB, largest rank)."""

    name: str
    times: list[float]
    peak_gib: float | None
    params: int
    trainable: int
    layers: int
    phases: dict[str, float] | None = None  # --phases: p50 ms of each phase


# A mixture of experts: attention and every routed expert (`all-linear` leaves the experts out, docs/models.md).
TARGETS = {"qwen3_moe": '["q_proj", "k_proj", "v_proj", "o_proj", "experts"]'}


def rows_of(args: argparse.Namespace, variant: str) -> int:
    """Sequences per rank in one step of `variant`: `--batch` per adapter."""
    return args.batch * max(1, adapters_of(variant)) if variant.startswith(MULTI_PREFIX) else args.batch


def job_toml(args: argparse.Namespace, variant: str) -> str:
    """The job the variant runs: the same shape and precision, with or without the "lora" converter."""
    lora = adapters_of(variant) > 0
    tables = "".join(f'[[adapters]]\nname = "a{k}"\n' for k in range(adapters_of(variant))) \
        if variant.startswith(MULTI_PREFIX) else ""
    return tables + f"""
[model]
name = "{args.model}"
flavor = "{args.flavor}"
converters = [{'"lora"' if lora else ""}]
[lora]
rank = 16
alpha = 32
dtype = "bfloat16"
target_modules = {TARGETS.get(args.model, '"all-linear"')}
replicate_adapters = {str(variant != "lora").lower()}
[training]
seq_len = {args.seq_len}
local_batch_size = {rows_of(args, variant)}
mixed_precision_param = "{args.mixed_precision_param}"
[optimizer]
implementation = "{args.optimizer_impl}"
[activation_checkpoint]
mode = "none"
[parallelism]
tensor_parallel_degree = {args.tp}
[compile]
enable = {str(args.compile).lower()}
components = ["model"]
"""


def quantile(times: list[float], q: float) -> float:
    """The q-quantile of `times` (the only value when there is one)."""
    return statistics.quantiles(times, n=100, method="inclusive")[int(q * 100) - 1] if len(times) > 1 else times[0]


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    """Return the previous variant's memory (FSDP modules hold reference cycles) and reset the peak."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def build(args: argparse.Namespace, variant: str, device: torch.device, dims):  # noqa: ANN001, ANN201
    """(job config, built model) for `variant`, with `--layers` applied and FSDP on a single rank too."""
    cfg, resolved = job_from_toml(job_toml(args, variant))
    if args.layers:
        resolved = dataclasses.replace(resolved, shape=dataclasses.replace(resolved.shape, n_layers=args.layers))
    built = build_model(cfg, dims, device, resolved)
    if not dims.fsdp_enabled:  # one rank: torchtitan would skip FSDP, and its bf16 params with it
        from torch.distributed.device_mesh import init_device_mesh

        shard_model(built.model, init_device_mesh(device.type, (1,), mesh_dim_names=("fsdp",)), cfg)
    if variant == "floor":
        built.model.requires_grad_(False)
        # The embedding's output is the leaf the backward reaches: every linear computes its input
        # gradient, and no param its own.
        built.model.tok_embeddings.register_forward_hook(lambda _m, _i, out: out.requires_grad_())
    return cfg, built


def step_fn(cfg, built, variant: str, tokens: torch.Tensor, labels: torch.Tensor, dims) -> Callable[[], None]:  # noqa: ANN001
    """One training step of `variant` (the floor: forward + backward only)."""
    model = built.model
    loss_fn = build_loss()
    n_tokens = labels.numel()
    if variant == "floor":
        return lambda: (loss_fn(model(tokens), labels) / n_tokens).backward()
    adapters = job_adapters(cfg) if variant.startswith(MULTI_PREFIX) else []
    optimizers = build_optimizers(model, cfg, adapter_optimizer_groups(adapters))
    trainable = [p for p in model.parameters() if p.requires_grad]
    rows = AdapterRows((tokens.shape[0] // len(adapters),) * len(adapters)) if adapters else None

    def scope() -> contextlib.AbstractContextManager:
        """Several adapters: each row through its own, the replicated adapters summed once a step."""
        stack = contextlib.ExitStack()
        if rows is not None:
            stack.enter_context(one_sum_for_the_step(model))
            stack.enter_context(routed(model, rows))
        return stack

    def clip() -> None:
        """One norm over the adapter, or each adapter clipped by its own (`TrainingRun.train_step`)."""
        if adapters:
            (groups,) = [opt.param_groups for opt in optimizers.optimizers]
            clip_per_adapter(groups, [a.max_norm for a in adapters], [a.name for a in adapters])
        else:
            clip_grad_norm_(trainable, cfg.training.max_norm, foreach=True)

    def step(marks: list[float] | None = None) -> None:
        """One step; with `marks`, the device is synchronised after each phase and the time appended."""
        def mark() -> None:
            if marks is not None:
                synchronize(tokens.device)
                marks.append(time.perf_counter())

        optimizers.zero_grad()
        mark()
        with scope():
            loss = loss_fn(model(tokens), labels) / n_tokens
            mark()
            loss.backward()
        mark()
        clip()
        mark()
        optimizers.step()
        mark()

    return step


PHASES = ("forward", "backward", "clip", "optimizer")


def phase_times(step: Callable[..., None], device: torch.device, steps: int) -> dict[str, float]:
    """p50 ms of each phase of `step`, the device synchronised between them (so they add up to more
    than a step, whose phases overlap host and device work); the slowest rank's per step."""
    per_phase: dict[str, list[float]] = {name: [] for name in PHASES}
    for _ in range(steps):
        dist.barrier()
        marks: list[float] = []
        step(marks)
        for name, start, end in zip(PHASES, marks, marks[1:]):
            per_phase[name].append((end - start) * 1e3)
    return {name: statistics.median(slowest_rank(times, device)) for name, times in per_phase.items()}




def slowest_rank(values: list[float], device: torch.device, op: dist.ReduceOp = dist.ReduceOp.MAX) -> list[float]:
    """Element-wise max over ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def run_variant(args: argparse.Namespace, variant: str, device: torch.device, dims) -> Result:  # noqa: ANN001
    """Build `variant`, warm up, time `--steps` steps; everything it built is freed on return."""
    free(device)
    cfg, built = build(args, variant, device, dims)
    model = built.model
    g = torch.Generator().manual_seed(0)
    vocab = model.tok_embeddings.num_embeddings
    tokens, labels = (torch.randint(0, vocab, (rows_of(args, variant), args.seq_len), generator=g).to(device) for _ in range(2))
    step = step_fn(cfg, built, variant, tokens, labels, dims)
    for _ in range(args.warmup):
        step()
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.steps):
        dist.barrier()
        synchronize(device)
        t0 = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    times = slowest_rank(times, device)
    peak = slowest_rank([peak], device)[0] if peak is not None else None
    if adapters_of(variant) and args.profile:
        profile(step, device, variant)
    phases = phase_times(step, device, args.steps) if args.phases and variant != "floor" else None
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    layers = len(model.layers)
    del cfg, built, model, step
    free(device)
    return Result(variant, times, peak, params, trainable, layers, phases)


def profile(step: Callable[[], None], device: torch.device, variant: str) -> None:
    """Rank 0 prints torch.profiler's top-15 ops of one step by self device time (CPU time on CPU)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        step()
        synchronize(device)
    if dist.get_rank() == 0:
        sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(f"\ntop-15 ops of one {describe(variant)} by {sort}")
        print(prof.key_averages().table(sort_by=sort, row_limit=15))


def report(args: argparse.Namespace, results: dict[str, Result], device: torch.device, world: int) -> None:
    """The table: p50/p90 per variant beside the floor, the LoRA/full ratio and the baseline."""
    full, floor = results["full"], results["floor"]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"\n{args.model} {args.flavor}, {full.layers} layers, {full.params / 1e9:.3f}B params, seq {args.seq_len} "
          f"x batch {args.batch} per rank, {world} rank(s) on {where}; {args.mixed_precision_param} params "
          f"(FSDP2), AdamW {args.optimizer_impl}{', compiled blocks' if args.compile else ''}; {args.steps} timed steps after {args.warmup} warm-up")
    print(f"{'variant':42s} {'trainable':>12s} {'p50 s':>9s} {'p90 s':>9s} {'peak GiB':>9s} {'x floor':>8s}")
    for r in results.values():
        med = statistics.median(r.times)
        peak = f"{r.peak_gib:9.1f}" if r.peak_gib is not None else f"{'-':>9s}"
        print(f"{describe(r.name):42s} {r.trainable:12,d} {med:9.4f} {quantile(r.times, 0.9):9.4f} {peak} "
              f"{med / statistics.median(floor.times):8.2f}")
    floor_ratio = statistics.median(floor.times) / statistics.median(full.times)
    for name in LORA_VARIANTS:
        ratio = statistics.median(results[name].times) / statistics.median(full.times)
        print(f"ratio {VARIANTS[name]} / full (p50): {ratio:.3f}  "
              f"(target <= {TARGET:.2f}; floor/full {floor_ratio:.3f})")
    print(f"baseline: {BASELINE}")
    one = results["lora_replicated"]
    for r in results.values():
        if r.name.startswith(MULTI_PREFIX):
            k = adapters_of(r.name)
            alone = k * statistics.median(one.times)
            mem = f"; peak {r.peak_gib / one.peak_gib:.2f}x one adapter's" if r.peak_gib and one.peak_gib else ""
            print(f"{k} adapters in one step {statistics.median(r.times):.4f} s vs {k} one-adapter steps "
                  f"{alone:.4f} s: {alone / statistics.median(r.times):.2f}x adapter-steps per second{mem}")
    for name in (n for n in results if adapters_of(n)):
        lora = results[name]
        if lora.phases and full.phases:
            print(f"phases of {describe(name)}, device synchronised between them (p50 ms): "
                  + "; ".join(f"{p} LoRA {lora.phases[p]:.1f} / full {full.phases[p]:.1f}" for p in PHASES))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's options."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["llama3", "qwen3", "qwen3_moe"], default="llama3")
    ap.add_argument("--flavor", default="8B", help="a torchtitan flavor of --model (debugmodel for a smoke test)")
    ap.add_argument("--layers", type=int, default=0, help="override n_layers (0: the flavor's) to fit the GPU")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1, help="sequences per rank")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (FSDP over the other ranks)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--mixed-precision-param", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--optimizer-impl", choices=["fused", "foreach", "for-loop"], default="fused")
    ap.add_argument("--device", choices=["auto", "cpu"], default="auto", help="auto: this rank's GPU if any")
    ap.add_argument("--profile", action="store_true", help="print the top-15 ops of one LoRA step")
    ap.add_argument("--phases", action="store_true",
                    help="also time forward, backward, clip and optimizer apart (device synchronised between)")
    ap.add_argument("--adapters", type=int, nargs="*", default=[],
                    help="also K adapters in one step of K x batch rows, for each K given (e.g. 2 4 8)")
    ap.add_argument("--compile", action="store_true", help="torch.compile each block and the loss, every variant")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Run the floor, LoRA and full variants one after another, then print the table on rank 0."""
    args = parse_args(argv)
    device = torch.device("cpu") if args.device == "cpu" else device_for_rank()
    init_distributed(device)
    if args.tp > 1 and dist.get_world_size() <= args.tp:
        raise SystemExit(f"--tp {args.tp} needs more than {args.tp} ranks (FSDP over the rest), got {dist.get_world_size()}")
    parallelism = job_from_toml(job_toml(args, "full"))[0].parallelism
    dims = build_parallel_dims(parallelism, dist.get_world_size(), device)
    variants = [*VARIANTS, *(f"{MULTI_PREFIX}{k}" for k in args.adapters)]
    results = {v: run_variant(args, v, device, dims) for v in variants}
    if dist.get_rank() == 0:
        report(args, results, device, dist.get_world_size())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
