"""Process-group set-up that works on CPU (gloo) and GPU (NCCL) alike (meshes: `titan_lora.titan.parallel`)."""

from __future__ import annotations

import datetime
import gc
import os

import torch
import torch.distributed as dist

from titan_lora.transfer.parent_death import die_with_parent


def device_for_rank() -> torch.device:
    """This rank's device: its GPU under torchrun when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def end_with_launcher() -> bool:
    """Under torchrun on Linux: this rank is SIGKILLed when torchrun's agent, its parent, dies; True when armed.

    torchrun starts every rank in a session of its own, so a kill of the job's process group (an OOM kill, a
    lost node, `kill -9 -- -PGID`) reaches the agent alone: the ranks trained on, orphaned, holding the engine
    rank 0 started (which ends with rank 0). SIGKILL, not SIGTERM: a rank blocked in a collective runs no
    Python signal handler until the collective times out.
    """
    return "TORCHELASTIC_RUN_ID" in os.environ and die_with_parent()


def init_distributed(device: torch.device, timeout_s: float = 600.0) -> None:
    """Start the default process group (NCCL on GPU, gloo on CPU); single process needs no launcher."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if "MASTER_ADDR" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a launcher's rendezvous
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    # One process, no launcher: an in-process store, so no TCP port can collide with another job's.
    os.environ["RANK"], os.environ["WORLD_SIZE"] = "0", "1"
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)



def leave_distributed(together: bool = True) -> None:
    """Destroy the default process group, after a barrier when `together` (the run finished on every rank).

    The caller drops its models first: DTensors that outlive the group keep its gloo threads to interpreter
    exit, where a rank then aborted about 1 exit in 7 ("terminate called without an active exception",
    measured on scripts/bench_base_stream.py's ranks; 0 in 70 with the collection below). Without the
    barrier, a rank tearing its gloo pairs down while a peer still drains the last collective aborts it.
    """
    if not dist.is_initialized():
        return
    if together:
        dist.barrier()
    gc.collect()
    dist.destroy_process_group()
