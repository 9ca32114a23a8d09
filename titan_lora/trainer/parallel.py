"""Which share of the data this rank trains on."""

from __future__ import annotations

import dataclasses

import torch.distributed as dist
from torchtitan.distributed import ParallelDims


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
            cp=parallelism.context_parallel_degree, tp=parallelism.tensor_parallel_degree,
            pp=parallelism.pipeline_parallel_degree, ep=parallelism.expert_parallel_degree,
            etp=parallelism.expert_tensor_parallel_degree, world_size=world_size,
        )
    except AssertionError as err:  # torchtitan's asserts often carry no text: say what must hold
        raise ValueError(
            f"[parallelism] does not fit {world_size} ranks{': ' + str(err) if str(err) else ''}; the product of "
            "the degrees (data_parallel_replicate, data_parallel_shard, context, tensor, pipeline) must equal the "
            "ranks launched (torchrun --nproc_per_node, titan-lora --nproc): lower the degrees or launch more "
            "ranks (data_parallel_shard_degree = -1 takes the ranks the others leave)"
        ) from None


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
