"""Process-group and device-mesh set-up that works on CPU (gloo) and GPU (NCCL) alike."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
import torchtitan.distributed.parallel_dims as titan_parallel_dims
from torchtitan.distributed import ParallelDims

from titan_lora.trainer.parallel import parallel_dims


def device_for_rank() -> torch.device:
    """This rank's device: its GPU under torchrun when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


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


def build_parallel_dims(parallelism, world_size: int, device: torch.device) -> ParallelDims:  # noqa: ANN001
    """torchtitan's ParallelDims from `[parallelism]`, with its mesh on `device`'s type."""
    # torchtitan picks the mesh device type at import time and falls back to "cuda" when no
    # accelerator is present; the mesh must be built on the device we actually run on.
    titan_parallel_dims.device_type = device.type
    dims = parallel_dims(parallelism, world_size)
    dims.build_mesh()
    return dims
