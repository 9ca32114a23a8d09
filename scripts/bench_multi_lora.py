"""K adapters on one linear, forward + backward on CPU: `titan_lora.lora.multi`'s per-segment loop against
`torch._grouped_mm` over the adapters' weights padded to the largest rank, and one adapter over all rows.

    python scripts/bench_multi_lora.py [--rows 1024] [--threads 1]

Shapes are SmolLM2-135M's (dim 576, MLP 1536); rows are tokens, sorted by adapter as `group_rows` leaves them.
Prints the median ms of each method per case; docs/multi_adapter.md records a run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_lora.lora.multi import AdapterShape, add_adapters
from titan_lora.lora.multi_rows import AdapterRows, routed

CASES = {  # name: (in, out, ranks, rows per adapter as fractions)
    "576x576 ranks 8/16/32": (576, 576, (8, 16, 32), (0.5, 0.25, 0.25)),
    "576x1536 ranks 8/16/32": (576, 1536, (8, 16, 32), (0.5, 0.25, 0.25)),
    "576x576 4 x rank 16": (576, 576, (16, 16, 16, 16), (0.25, 0.25, 0.25, 0.25)),
}


def loop_layer(d_in: int, d_out: int, ranks: tuple[int, ...]) -> nn.Linear:
    """The layer as titan_lora builds it: one A/B pair per adapter at its own rank."""
    linear = nn.Linear(d_in, d_out, bias=False).requires_grad_(False)
    add_adapters(linear, [AdapterShape(r, 2.0) for r in ranks])
    for name, param in linear.named_parameters():
        if name.startswith("lora_"):
            nn.init.normal_(param, std=0.02)
    return linear


def grouped_forward(linear: nn.Linear, x: torch.Tensor, rows: AdapterRows) -> torch.Tensor:
    """The same math with two grouped matmuls over weights zero-padded to the largest rank."""
    k = len(rows.counts)
    a_list = [getattr(linear, f"lora_A_{i}") for i in range(k)]
    b_list = [getattr(linear, f"lora_B_{i}") for i in range(k)]
    top = max(t.shape[0] for t in a_list)
    a = torch.stack([F.pad(t, (0, 0, 0, top - t.shape[0])).T for t in a_list])  # (K, in, top)
    b = torch.stack([F.pad(t, (0, top - t.shape[1])).T for t in b_list])  # (K, top, out)
    offs = torch.tensor(rows.offsets[1:], dtype=torch.int32)
    scales = torch.repeat_interleave(torch.tensor([linear.adapter_scales[i] for i in range(k)]),
                                     torch.tensor(rows.counts)).unsqueeze(1)
    update = torch._grouped_mm(torch._grouped_mm(x, a.contiguous(), offs), b.contiguous(), offs)
    return F.linear(x, linear.weight) + update * scales


def timed(fn, rounds: int) -> float:  # noqa: ANN001
    """Median ms of `fn` over `rounds` runs after one warm-up."""
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    """Time each method on each case; print a table row per case."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"| case ({args.rows} rows, fp32, {args.threads} thread) | per-segment loop | grouped_mm (padded) "
          "| one adapter, max rank, all rows |")
    for name, (d_in, d_out, ranks, shares) in CASES.items():
        counts = [int(args.rows * s) for s in shares]
        counts[-1] = args.rows - sum(counts[:-1])
        rows = AdapterRows(tuple(counts))
        linear = loop_layer(d_in, d_out, ranks)
        single = loop_layer(d_in, d_out, (max(ranks),))
        x = torch.randn(args.rows, d_in, requires_grad=True)
        grad = torch.randn(args.rows, d_out)

        def loop() -> None:
            with routed(linear, rows):
                linear(x).backward(grad)

        def grouped() -> None:
            grouped_forward(linear, x, rows).backward(grad)

        def one() -> None:
            with routed(single, AdapterRows((args.rows,))):
                single(x).backward(grad)

        with routed(linear, rows):
            torch.testing.assert_close(grouped_forward(linear, x, rows), linear(x))
        print(f"| {name} | {timed(loop, args.rounds):.2f} | {timed(grouped, args.rounds):.2f} "
              f"| {timed(one, args.rounds):.2f} |")


if __name__ == "__main__":
    main()
