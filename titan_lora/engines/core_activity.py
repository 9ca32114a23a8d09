"""Whether vLLM's engine processes were computing while LIVE's no-op waited behind them.

An engine core runs a `collective_rpc` between two engine steps, so one long step (a prefill of thousands
of tokens on a CPU core: seconds) delays LIVE past its bound exactly as a wedged core does. The two differ
in CPU demand: a step in progress burns CPU time, or waits in the run queue for a core while other processes
use them (a busy host: CPU time alone then reads ~0.03 of the wait, as a wedge would); a stopped or
deadlocked process does neither. On a CPU engine the front samples, around the wait, every `VLLM::`
process under it: its CPU time plus the time its threads waited runnable for a core (Linux's
/proc/<pid>/task/<tid>/schedstat; CPU time alone where the kernel keeps no schedstat), and calls the engine
busy (live) only if each of them wanted the CPU for at least `BUSY_CPU_SHARE` of the wait. Not on GPUs: a worker
stuck in a NCCL collective spins a CPU core while it hangs, and a GPU step outlasting the bound is rare.
A core that spins forever without finishing a step is then not found by LIVE; its requests' own timeouts
(`[weight_sync] rollout_timeout_s`) end it. Every process must have computed: on a data-parallel CPU engine
whose other rank sits idle, a long step still reads as a wedge (the rank that answered is not known here).
"""

from __future__ import annotations

import dataclasses
import os
import time

import psutil

BUSY_CPU_SHARE = 0.1
"""The least CPU demand (CPU time plus run-queue wait) each engine process must have had, as a share of the
wait, to count as busy. A SIGSTOPped or deadlocked process has ~0; a step in progress ~1 per thread, however
many other processes share the cores."""
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


def _run_queue_wait_s(pid: int) -> float:
    """Seconds the threads of `pid` have spent runnable but waiting for a core (0 without schedstat)."""
    waited_ns = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:  # "<ns on a CPU> <ns waiting on a run queue> <timeslices>"
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                waited_ns += int(f.read().split()[1])
        except (OSError, ValueError, IndexError):  # a thread gone meanwhile, or no schedstat
            continue
    return waited_ns / 1e9


def _demand_s(proc: psutil.Process) -> float | None:
    """CPU seconds `proc` used plus those its threads waited for a core; None when it is gone."""
    try:
        times = proc.cpu_times()
    except psutil.Error:
        return None
    return times.user + times.system + _run_queue_wait_s(proc.pid)


@dataclasses.dataclass
class CpuSample:
    """The engine processes' CPU demand (CPU plus run-queue wait seconds) at one moment, and when it was taken."""

    at: float
    cpu_s: dict[int, float]

    @classmethod
    def now(cls, procs: list[psutil.Process]) -> CpuSample:
        """A sample of `procs` (those already gone are left out)."""
        return cls(time.monotonic(), {p.pid: s for p in procs if (s := _demand_s(p)) is not None})


def busy_shares(before: CpuSample, after: CpuSample) -> dict[int, float]:
    """Each process's CPU demand between the samples over the wall seconds between them (a process gone
    by `after` gets 0: it computed nothing that will finish the step; a thread gone meanwhile takes its
    run-queue wait with it, hence the floor at 0)."""
    wall = max(after.at - before.at, 1e-9)
    return {pid: (max(after.cpu_s[pid] - cpu, 0.0) / wall if pid in after.cpu_s else 0.0)
            for pid, cpu in before.cpu_s.items()}


def were_busy(shares: dict[int, float], share: float = BUSY_CPU_SHARE) -> bool:
    """True when there were engine processes and every one of them wanted the CPU for `share` of the wait."""
    return bool(shares) and min(shares.values()) >= share
