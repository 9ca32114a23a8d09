"""Checks that need several sections (or the host), run on the parsed config before any model is built."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from titan_lora.clients.base import registered_emitters
from titan_lora.clients.launch import engine_lora_rank
from titan_lora.trainer.checkpoint import check_resume_compatible
from titan_lora.trainer.parallel import data_parallel_size
from titan_lora.transfer.transport import SHM_DIR

SHM_EMITTERS = ("vllm", "disk")  # their buckets travel through POSIX shared memory on CPU


def check_parallelism(job_config) -> None:  # noqa: ANN001
    """Refuse what titan_lora's LoRA model cannot run: pipeline or context parallelism, torch.compile."""
    par = job_config.parallelism
    if par.pipeline_parallel_degree > 1 or par.context_parallel_degree > 1:
        raise ValueError(
            f"[parallelism] pipeline_parallel_degree = {par.pipeline_parallel_degree}, "
            f"context_parallel_degree = {par.context_parallel_degree}: titan_lora supports data (FSDP/HSDP) "
            "and tensor parallelism; set both to 1"
        )
    if job_config.compile.enable:
        raise ValueError("[compile] enable = true is not supported with LoRA yet; set it to false")


def check_emitter(emitter: str) -> None:
    """Refuse an `[weight_sync] emitter` that is not registered."""
    if emitter not in registered_emitters():
        known = ", ".join(registered_emitters())
        raise ValueError(f"[weight_sync] emitter = {emitter!r} is unknown; use one of {known}")


def check_shared_memory(bucket_mb: int, shm_dir: str = SHM_DIR) -> None:
    """Refuse buckets that do not fit in the free shared memory (the emitter keeps two of them)."""
    if not os.path.isdir(shm_dir):
        return
    st = os.statvfs(shm_dir)
    free_mb = st.f_bavail * st.f_frsize // 2**20
    if 2 * bucket_mb > free_mb:
        raise ValueError(
            f"[weight_sync] bucket_mb = {bucket_mb}: the emitter double-buffers, which needs "
            f"{2 * bucket_mb} MiB of {shm_dir}, but only {free_mb} MiB is free; lower bucket_mb to at most "
            f"{free_mb // 2} "
            "or enlarge /dev/shm (docker: --shm-size)"
        )


def check_grpo_split(prompts_per_step: int, group_size: int, dp_size: int) -> None:
    """Refuse a GRPO batch that the data-parallel ranks cannot share equally."""
    n = prompts_per_step * group_size
    if n % dp_size:
        raise ValueError(
            f"[grpo] prompts_per_step * group_size = {prompts_per_step} * {group_size} = {n} samples do not "
            f"split over {dp_size} data-parallel ranks; make it a multiple of {dp_size}"
        )


def check_sync(job_config) -> None:  # noqa: ANN001
    """The `[weight_sync]` checks that need the registry, the host or other sections."""
    ws = job_config.weight_sync
    if not ws.enabled:
        return
    check_emitter(ws.emitter)
    if ws.emitter in SHM_EMITTERS and not torch.cuda.is_available():
        check_shared_memory(ws.bucket_mb)
    embedded_receiver = not ws.engine_url and ws.engine == "receiver"  # no vLLM: no rank limit
    if ws.emitter in ("vllm", "disk") and not embedded_receiver and "lora" in job_config.model.converters:
        engine_lora_rank(job_config.lora.rank)  # raises when no vLLM engine can serve the rank


def check_rollback(job_config) -> None:  # noqa: ANN001
    """Rolling back needs checkpoints to roll back to."""
    if job_config.weight_sync.on_nonfinite == "rollback" and not job_config.checkpoint.enable:
        raise ValueError('[weight_sync] on_nonfinite = "rollback" reloads the last checkpoint: set '
                         '[checkpoint] enable = true (or on_nonfinite = "stop")')


def preflight(job_config, targets: list[str] | None) -> None:  # noqa: ANN001
    """Every cross-section check; `targets` are the adapted linears (None: no LoRA)."""
    check_parallelism(job_config)
    check_rollback(job_config)
    check_sync(job_config)
    if job_config.grpo.enabled:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        dp = data_parallel_size(job_config.parallelism, world_size)
        check_grpo_split(job_config.grpo.prompts_per_step, job_config.grpo.group_size, dp)
    if job_config.checkpoint.enable and targets is not None:
        folder = Path(job_config.job.dump_folder) / job_config.checkpoint.folder
        check_resume_compatible(folder, job_config.lora.rank, targets)
