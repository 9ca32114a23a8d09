"""Run a function on N ranks with torch.multiprocessing, as torchrun would: gloo on CPU (the suite's
default) or NCCL with one GPU per rank (`pytest -m gpu`).

Gloo ranks are forked from a forkserver that imported torch, torchtitan and transformers once
(`PRELOAD`), not spawned: a spawned rank imported them again, 10-40 s per call on 2 shared cores, in every
call of the suite's multi-rank tests. Each rank still starts from the caller's environment, working
directory, `sys.path`, stdout and stderr as they are at the call (`_worker` applies them), as a spawned
one did.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from wait_helpers import waited

PRELOAD = ["torch", "torch.distributed", "titan_lora.trainer.build", "transformers"]
"""What the forkserver imports once for every rank: torch, torchtitan behind the trainer's build, and HF
transformers, each 10-15 s to import on 2 shared cores. None starts a thread or reads the environment at
import, so forking from them is safe and a rank sees its caller's environment."""


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def needs_gpus(n: int) -> Callable[[Callable], Callable]:
    """Mark a test `gpu` and skip it on hosts with fewer than `n` GPUs (a CPU build answers at once)."""
    have = torch.cuda.device_count()
    skip = pytest.mark.skipif(have < n, reason=f"needs {n} CUDA GPUs, this host has {have}")
    return lambda test: pytest.mark.gpu(skip(test))


def rank_device() -> torch.device:
    """This rank's device: its GPU when the process group runs NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _CallerStdio:
    """The caller's stdout and stderr at the call (pytest's capture of the running test), sent to a rank with
    its process: a forked rank would otherwise write where the forkserver's first caller did."""

    def __reduce__(self) -> tuple[Callable, tuple]:
        from multiprocessing.reduction import DupFd  # only while the process is being sent

        return _write_to, (DupFd(1), DupFd(2))


def _write_to(out: Any, err: Any) -> None:
    """In the rank, as its process arrives: write to the caller's stdout and stderr."""
    for target, wrapped in ((1, out), (2, err)):
        fd = wrapped.detach()
        os.dup2(fd, target)
        os.close(fd)


def _worker(rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple, errors: Any,
            caller: tuple[dict[str, str], str, list[str], None]) -> None:
    env, cwd, path, _ = caller  # the forkserver's own are those of its first caller
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )
    try:
        kwargs = {}
        if backend == "nccl":  # one GPU per rank, bound before the first collective
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
            kwargs["device_id"] = device
        dist.init_process_group(backend, rank=rank, world_size=world, **kwargs)
        fn(rank, world, *args)
        # A rank that tears its gloo pairs down while a peer still drains the last collective makes
        # that peer's gloo thread abort (SIGABRT at exit, seen in CI): leave together.
        dist.barrier()
    except BaseException:  # reported to the parent, which fails the test
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    _leave()


def _leave() -> None:
    """End a rank whose work passed: our exit handlers (shared-memory names, logs), then no C++ teardown.

    torch's static destructors at interpreter exit abort a rank now and then after its peers have gone
    ("terminate called without an active exception", no Python frame; rank 0, which hosts the TCPStore,
    about 1 run in 20 of the fastest test): a crash after every assertion held, not a result.
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(world: int, fn: Callable, *args: Any, backend: str = "gloo") -> None:
    """Run `fn(rank, world, *args)` on `world` ranks of `backend` ("gloo": CPU; "nccl": rank r on GPU r);
    re-raise the first rank's error."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise RuntimeError(f"{world} NCCL ranks need {world} GPUs, this host has {torch.cuda.device_count()}")
    # NCCL ranks (GPU hosts) are spawned: a forkserver whose imports touched CUDA could not fork them.
    ctx = mp.get_context("forkserver" if backend == "gloo" else "spawn")
    if backend == "gloo":
        ctx.set_forkserver_preload(PRELOAD)  # read when the server starts, at the first call
    errors = ctx.SimpleQueue()
    port = free_port()
    caller = (dict(os.environ), os.getcwd(), list(sys.path), _CallerStdio())
    procs = [ctx.Process(target=_worker, args=(r, world, port, backend, fn, args, errors, caller))
             for r in range(world)]
    for p in procs:
        p.start()
    finished = _wait(procs, errors, timeout_s=900)
    if not errors.empty():
        raise AssertionError(errors.get())
    assert finished, "ranks still running after 900 s: stopped"
    codes = [p.exitcode for p in procs]
    assert codes == [0] * world, f"ranks exited with {codes}"


def _wait(procs: list, errors: Any, timeout_s: float, grace_s: float = 10.0) -> bool:
    """Wait for every rank, then stop any left. Once one failed, the others get `grace_s` to end on their
    own: they would wait for it in their next collective until the timeout. True when all ended."""
    def ended() -> bool:
        return not any(p.is_alive() for p in procs)

    waited(lambda: ended() or not errors.empty(), timeout_s, poll_s=0.05)
    finished = waited(ended, grace_s if not errors.empty() else 0.0, poll_s=0.05)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    return finished
