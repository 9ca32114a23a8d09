"""A CPU engine that misses LIVE's bound while computing is busy, not wedged: the rule on real processes
titled as vLLM titles its engine core (one spinning, one SIGSTOPped, one spinning on a host whose every core
another process keeps busy), and on hand-made samples."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from titan_lora.engines.core_activity import CpuSample, busy_shares, engine_processes, were_busy

# PR_SET_NAME (15) titles the process as vLLM does its engine core, then it spins or sleeps.
CHILD = ("import ctypes, os, sys, time; ctypes.CDLL(None).prctl(15, b'VLLM::EngineCore', 0, 0, 0); "
         "os.nice(int(sys.argv[2]))\n"
         "print('ready', flush=True)\n"
         "if sys.argv[1] == 'spin':\n    while True: pass\nelse:\n    time.sleep(600)")


@pytest.fixture
def child():
    procs: list[subprocess.Popen] = []

    def start(mode: str, nice: int = 0) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, mode, str(nice)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def asleep(pid: int, timeout_s: float = 30) -> None:
    """Wait until process `pid` sleeps (it has printed "ready" and may still wait for a core to reach sleep)."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while psutil.Process(pid).status() != psutil.STATUS_SLEEPING:
        assert time.monotonic() < deadline, f"process {pid} never went to sleep"
        time.sleep(0.01)


def shares_over(seconds: float) -> dict[int, float]:
    procs = engine_processes()
    before = CpuSample.now(procs)
    time.sleep(seconds)
    return busy_shares(before, CpuSample.now(procs))


def test_a_computing_core_is_busy_and_a_stopped_or_sleeping_one_is_not(child) -> None:
    spinning = child("spin")
    shares = shares_over(0.5)
    assert set(shares) == {spinning.pid}, "the titled child is found, this process and others are not"
    assert shares[spinning.pid] > 0.3 and were_busy(shares)
    os.kill(spinning.pid, signal.SIGSTOP)
    try:
        shares = shares_over(0.5)
        assert shares[spinning.pid] < 0.05 and not were_busy(shares), "a SIGSTOPped core computes nothing"
    finally:
        os.kill(spinning.pid, signal.SIGCONT)
    sleeping = child("sleep")  # a deadlocked worker beside a computing core: the engine is wedged
    asleep(sleeping.pid)  # else, on a loaded host, its wait for a core on the way to sleep counts as demand
    shares = shares_over(0.5)
    assert set(shares) == {spinning.pid, sleeping.pid} and not were_busy(shares)


def test_no_engine_process_or_one_gone_during_the_wait_is_not_busy() -> None:
    assert not were_busy({}), "a core in the front's own process: the wait alone cannot tell"
    before, after = CpuSample(0.0, {1: 5.0, 2: 7.0}), CpuSample(2.0, {1: 6.0})
    assert busy_shares(before, after) == {1: 0.5, 2: 0.0}, "a process gone meanwhile computed nothing"
    assert not were_busy(busy_shares(before, after))
    assert were_busy({1: 0.5, 3: 0.1}) and not were_busy({1: 0.5, 3: 0.09})


def test_a_core_starved_by_other_processes_on_every_core_is_busy(child) -> None:
    # The engine core at nice 19 beside one busy process per core at nice 0: it gets ~1.5% of a core, as
    # when a trainer's ranks and another job share a small host, yet it is computing a step, not wedged.
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(len(os.sched_getaffinity(0)))]
    try:
        starved = child("spin", 19)
        time.sleep(0.3)  # the hogs are up
        procs = engine_processes()
        cpu_before, sample = sum(procs[0].cpu_times()[:2]), CpuSample.now(procs)
        time.sleep(1.5)
        cpu_after, shares = sum(procs[0].cpu_times()[:2]), busy_shares(sample, CpuSample.now(procs))
        cpu_share = (cpu_after - cpu_before) / 1.5
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert set(shares) == {starved.pid}
    assert cpu_share < 0.1, f"the core was not starved (CPU time / wait {cpu_share:.2f}): the case is not made"
    assert were_busy(shares), f"a starved, computing core read wedged: {shares}"
