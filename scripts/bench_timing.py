"""Timing helpers of the benchmarks: wall times in ms, alternation, quantiles (torch-free, import-light:
the nccl benchmark runs where torchtitan and vLLM are not installed)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def timed(fn: Callable[[], object], iters: int, sync: Callable[[], None] = lambda: None, warmup: int = 2,
          between: Callable[[], object] = lambda: None) -> list[float]:
    """Wall times of `fn` in ms (after `warmup` calls), with `sync` closing each timing and `between`
    run untimed after each call."""
    for _ in range(warmup):
        fn()
        sync()
        between()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        between()
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
