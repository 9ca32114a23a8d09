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


def data_parallel_info(dims: ParallelDims) -> DataParallelInfo:
    """DP rank, size and group from torchtitan's "batch" mesh (HSDP replicas x FSDP shards)."""
    mesh = dims.get_optional_mesh("batch")
    if mesh is None:
        return DataParallelInfo(0, 1, None)
    return DataParallelInfo(mesh.get_local_rank(), mesh.size(), mesh.get_group())
