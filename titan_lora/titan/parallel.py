"""torchtitan's parallelism: ParallelDims from `[parallelism]`, its device meshes, which share of the data a
rank trains on, and activation checkpointing and compile on a model's blocks.

Part of the seam (`titan_lora.titan`), on torchtitan 0.3.0: its `spmd_backend` is forced to
"partial_dtensor" (DTensors on the model-parallel axes only, FSDP on its own "fsdp" mesh: titan_lora's
replicated adapters and TP placements are built on it; 0.3.0's default "spmd_types" fails at FSDP wrap time on
torch 2.13). TP is `Module.parallelize` on the configs' shardings; AC and compile go through config objects.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
import torchtitan.distributed.parallel_dims as titan_parallel_dims
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.compile import apply_compile
from torch.distributed.tensor import DTensor
from torchtitan.distributed.utils import set_spmd_backend

from titan_lora.titan.configs import SPMD_BACKEND, titan_ac, titan_compile
from titan_lora.titan.models import output_head

__all__ = ["DataParallelInfo", "ParallelDims", "build_parallel_dims", "checkpoint_and_compile",
           "data_parallel_info", "data_parallel_mesh", "data_parallel_size", "parallel_dims", "tensor_parallel"]


@dataclasses.dataclass(frozen=True)
class DataParallelInfo:
    """This rank's data-parallel coordinate; TP peers share one coordinate and see the same data."""

    rank: int
    size: int
    group: dist.ProcessGroup | None


def parallel_dims(parallelism, world_size: int) -> ParallelDims:  # noqa: ANN001
    """torchtitan's ParallelDims for `[parallelism]` on `world_size` ranks (no mesh yet; -1 resolved)."""
    try:
        return ParallelDims(
            dp_shard=parallelism.data_parallel_shard_degree,
            dp_replicate=parallelism.data_parallel_replicate_degree,
            cp=1, tp=parallelism.tensor_parallel_degree, pp=1, ep=1, world_size=world_size,
            spmd_backend=SPMD_BACKEND,
        )
    except AssertionError as err:  # torchtitan's asserts often carry no text: say what must hold
        raise ValueError(
            f"[parallelism] does not fit {world_size} ranks{': ' + str(err) if str(err) else ''}; the product of "
            "the degrees (data_parallel_replicate, data_parallel_shard, tensor) must equal the "
            "ranks launched (torchrun --nproc_per_node, titan-lora --nproc): lower the degrees or launch more "
            "ranks (data_parallel_shard_degree = -1 takes the ranks the others leave)"
        ) from None


def build_parallel_dims(parallelism, world_size: int, device: torch.device) -> ParallelDims:  # noqa: ANN001
    """torchtitan's ParallelDims from `[parallelism]`, with its mesh on `device`'s type."""
    # torchtitan picks the mesh device type at import time and falls back to "cuda" when no
    # accelerator is present; the mesh must be built on the device we actually run on.
    titan_parallel_dims.device_type = device.type
    dims = parallel_dims(parallelism, world_size)
    dims.build_mesh()
    set_spmd_backend(SPMD_BACKEND)  # as torchtitan's Trainer does (trainer.py:319)
    return dims


def data_parallel_size(parallelism, world_size: int) -> int:  # noqa: ANN001
    """The DP degree (replicas x shards) torchtitan derives from `[parallelism]` on `world_size` ranks."""
    dims = parallel_dims(parallelism, world_size)
    return dims.dp_replicate * dims.dp_shard


def data_parallel_info(dims: ParallelDims) -> DataParallelInfo:
    """DP rank, size and group from torchtitan's "batch" mesh (HSDP replicas x FSDP shards)."""
    mesh = dims.get_optional_mesh("batch")
    if mesh is None:
        return DataParallelInfo(0, 1, None)
    return DataParallelInfo(mesh.get_local_rank(), mesh.size(), mesh.get_group())


def data_parallel_mesh(parallel_dims: ParallelDims) -> DeviceMesh:
    """The data-parallel ranks' mesh: FSDP's (HSDP: replicate x shard), or the replicas alone."""
    names = [name for name, on in (("dp_replicate", parallel_dims.dp_replicate_enabled),
                                   ("fsdp", parallel_dims.fsdp_enabled)) if on]
    return parallel_dims.get_mesh(names)


def tensor_parallel(model: nn.Module, parallel_dims: ParallelDims) -> None:
    """TP on a meta-device model built from configs whose shardings `[parallelism]` filled
    (`Architecture.meta_model(..., parallelism=...)`): each module's params placed by its config, adapters
    included (`lora_linear.adapter_shardings`); requires_grad is kept (protocols/module.py:377).

    The head's logits, all-gathered to whole rows (`models.replicated_logits`), come out as this rank's plain
    tensor, as 0.2.2's `ColwiseParallel(use_local_output=True)` gave them: titan_lora's losses mix them with
    plain tensors (labels, masks). Each TP rank computes the same loss, so the local copy's gradient is the
    replicated gradient."""
    model.parallelize(parallel_dims)
    if getattr(model, "enable_weight_tying", False):
        # parallelize gives each module a DTensor of its own; FSDP must see the tied pair as one parameter (the
        # two have the same placement: vocabulary rows sharded over tp).
        model.tok_embeddings.weight = model.lm_head.weight
    head = output_head(model)
    if head is not None:
        head.register_forward_hook(_local_logits)


def _local_logits(module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
    if isinstance(output, DTensor) and all(p.is_replicate() for p in output.placements):
        return output.to_local()
    return output


def checkpoint_and_compile(model: nn.Module, job_config, parallel_dims: ParallelDims) -> None:  # noqa: ANN001
    """`[activation_checkpoint]`, then `[compile]`, on the model's blocks, in place (torchtitan's order: FSDP
    comes after both)."""
    ac = titan_ac(job_config.activation_checkpoint)
    if ac is not None:
        ac.build(dump_folder=job_config.job.dump_folder).apply(model)
    if job_config.compile.enable and "model" in job_config.compile.components:
        # Each block compiles once (they share code), in place: parameter names do not change.
        apply_compile(model, compile_config=titan_compile(job_config.compile), parallel_dims=parallel_dims)
