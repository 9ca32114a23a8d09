"""The service's memory for one big training call: the peak resident memory one mixed step adds, run in
micro-batches of `[service] micro_batch_tokens` against the same step in one forward and backward (what the
service did before micro-batches, and what a server that batches a call whole does), in one run.

    python scripts/bench_service_memory.py [--rows 48] [--tokens 180] [--micro-batch-tokens 1024]

SmolLM2-135M (pretrained), a rank-8 client, one importance_sampling request of `--rows` datums of `--tokens`
tokens (an RL batch: tinker-cookbook's rl_loop sends every datum of a batch in one call). Each variant runs in
a fresh process (peak RSS is per process). Floor: the process before the step (model, slots, optimizer);
figures: what the step adds on top of it, and the step's time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def one_step(rows: int, tokens: int, micro_batch_tokens: int) -> dict[str, float]:
    """In this process: the floor RSS, the peak RSS after one step, the step's seconds."""
    import resource
    import time

    import numpy as np
    import torch

    from titan_lora.service.main import build_slots, service_job
    from titan_lora.service.slots import SlotSpec
    from titan_lora.service.step import Limits, Work, run_step
    from titan_lora.service.wire import Datum, ForwardBackward
    from titan_lora.trainer.distributed import init_distributed
    from titan_lora.trainer.job_config import load_job

    cpu = torch.device("cpu")
    init_distributed(cpu)
    cfg, resolved = load_job(["--job.config_file", str(ROOT / "train_configs/smollm2_service.toml")])
    built, slots, _ = build_slots(service_job(cfg), resolved, cpu)
    slots.claim(0, SlotSpec(rank=8, seed=1))
    rng = np.random.default_rng(0)
    data = []
    for _ in range(rows):
        ids = rng.integers(3, 40000, tokens + 1)
        advantages = np.r_[np.zeros(tokens - 32), np.full(32, 0.5)].astype(np.float32)
        data.append(Datum(ids[:-1], {"target_tokens": ids[1:], "logprobs": np.full(tokens, -2.0, np.float32),
                                     "advantages": advantages}))
    request = ForwardBackward("m", 1, "importance_sampling", {}, False, data)
    limits = Limits(resolved.shape.vocab_size, 2048, 1 << 30, micro_batch_tokens)
    floor = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    (outcome,) = run_step(built.model, [Work(0, request)], slots.count, limits, cpu)
    seconds = time.perf_counter() - start
    assert outcome.error is None, outcome.error
    return {"floor_mib": floor, "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "seconds": seconds}


def measured(rows: int, tokens: int, micro_batch_tokens: int) -> dict[str, float]:
    """`one_step` in a fresh process."""
    done = subprocess.run([sys.executable, __file__, "--rows", str(rows), "--tokens", str(tokens),
                           "--micro-batch-tokens", str(micro_batch_tokens), "--one"],
                          capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    """Both variants, then the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=180)
    parser.add_argument("--micro-batch-tokens", type=int, default=1024)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_step(args.rows, args.tokens, args.micro_batch_tokens)))
        return
    ours = measured(args.rows, args.tokens, args.micro_batch_tokens)
    whole = measured(args.rows, args.tokens, args.rows * args.tokens)
    added, baseline = ours["peak_mib"] - ours["floor_mib"], whole["peak_mib"] - whole["floor_mib"]
    print(f"one importance_sampling call of {args.rows} datums x {args.tokens} tokens, SmolLM2-135M, rank 8:")
    print(f"  floor (the process before the step)   {ours['floor_mib']:8.0f} MiB")
    print(f"  micro-batches of {args.micro_batch_tokens:5d} tokens      +{added:7.0f} MiB  {ours['seconds']:6.1f} s"
          f"   peak {ours['peak_mib'] / ours['floor_mib']:.2f}x the floor")
    print(f"  one forward (baseline)              +{baseline:7.0f} MiB  {whole['seconds']:6.1f} s"
          f"   peak {whole['peak_mib'] / whole['floor_mib']:.2f}x the floor")
    print(f"  added memory: micro-batches / one forward = {added / baseline:.2f}x; "
          f"time {ours['seconds'] / whole['seconds']:.2f}x")


if __name__ == "__main__":
    main()
