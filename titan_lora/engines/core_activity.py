"""Whether vLLM's engine processes were computing while LIVE's no-op waited behind them.

An engine core runs a `collective_rpc` between two engine steps, so one long step (a prefill of thousands
of tokens on a CPU core: seconds) delays LIVE past its bound exactly as a wedged core does. The two differ
in CPU time: a step in progress burns it; a stopped or deadlocked process burns none. On a CPU engine the
front samples the CPU time of every `VLLM::` process under it around the wait, and calls the engine busy
(live) only if each of them computed for at least `BUSY_CPU_SHARE` of the wait. Not on GPUs: a worker
stuck in a NCCL collective spins a CPU core while it hangs, and a GPU step outlasting the bound is rare.
A core that spins forever without finishing a step is then not found by LIVE; its requests' own timeouts
(`[weight_sync] rollout_timeout_s`) end it. Every process must have computed: on a data-parallel CPU engine
whose other rank sits idle, a long step still reads as a wedge (the rank that answered is not known here).
"""

from __future__ import annotations

import dataclasses
import time

import psutil

BUSY_CPU_SHARE = 0.1
"""The least CPU time each engine process must have used, as a share of the wait, to count as busy.
A SIGSTOPped or deadlocked process uses ~0; a step in progress ~1 per thread, or a third of it on a host
whose cores the trainer's ranks also use."""
ENGINE_PROCESS_PREFIX = "VLLM::"
"""vLLM titles its engine-core and worker processes `VLLM::EngineCore`, `VLLM::Worker...`."""


def engine_processes() -> list[psutil.Process]:
    """The engine-core and worker processes under this front (none when the core runs in-process)."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.name().startswith(ENGINE_PROCESS_PREFIX):
                found.append(proc)
        except psutil.Error:  # gone meanwhile
            continue
    return found


def _cpu_s(proc: psutil.Process) -> float | None:
    try:
        times = proc.cpu_times()
    except psutil.Error:
        return None
    return times.user + times.system


@dataclasses.dataclass
class CpuSample:
    """The engine processes' CPU seconds at one moment, and when it was taken."""

    at: float
    cpu_s: dict[int, float]

    @classmethod
    def now(cls, procs: list[psutil.Process]) -> CpuSample:
        """A sample of `procs` (those already gone are left out)."""
        return cls(time.monotonic(), {p.pid: s for p in procs if (s := _cpu_s(p)) is not None})


def busy_shares(before: CpuSample, after: CpuSample) -> dict[int, float]:
    """Each process's CPU seconds between the samples over the wall seconds between them (a process gone
    by `after` gets 0: it computed nothing that will finish the step)."""
    wall = max(after.at - before.at, 1e-9)
    return {pid: (max(after.cpu_s[pid] - cpu, 0.0) / wall if pid in after.cpu_s else 0.0)
            for pid, cpu in before.cpu_s.items()}


def were_busy(shares: dict[int, float], share: float = BUSY_CPU_SHARE) -> bool:
    """True when there were engine processes and every one of them computed for `share` of the wait."""
    return bool(shares) and min(shares.values()) >= share
