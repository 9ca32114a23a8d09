"""Run a function on N CPU ranks (gloo) with torch.multiprocessing, as torchrun would."""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, errors: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        fn(rank, world, *args)
        # A rank that tears its gloo pairs down while a peer still drains the last collective makes
        # that peer's gloo thread abort (SIGABRT at exit, seen in CI): leave together.
        dist.barrier()
    except BaseException:  # noqa: BLE001 (reported to the parent, which fails the test)
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn: Callable, *args: Any) -> None:
    """Run `fn(rank, world, *args)` on `world` gloo ranks; re-raise the first rank's error."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, errors)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=900)
    if not errors.empty():
        raise AssertionError(errors.get())
    codes = [p.exitcode for p in procs]
    assert codes == [0] * world, f"ranks exited with {codes}"

