"""Gather every adapter shard onto rank 0 in one collective.

A per-parameter `full_tensor()` loop costs one collective per tensor (448 for an 8B model with LoRA
on all linears), and a naive coalesced gather spends its time on `torch.cat`, a size exchange and host
syncs. Here all shapes and shard layouts are fixed at construction, so each sync is:
one copy of the local shards into a preallocated send buffer, one `dist.gather` into a preallocated
receive buffer, and one `index_copy_` that scatters every element to its place in the full tensors.

The scatter index is built once, from each param's own DTensor placements (a sharded arange), so it
holds for any mix of FSDP and TP placements, uneven shards included. Every rank must call `gather`
in the same order: it is a collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_lora.emitters.buckets import ALIGN

# Maps a tensor of output positions, laid out as the output wants the param, into the trainer's
# layout of that param (e.g. undoing a row permutation), so the scatter writes the output layout.
Layout = Callable[[torch.Tensor], torch.Tensor]


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def _global_flat_index(param: torch.Tensor, offset: int, layout: Layout | None) -> torch.Tensor:
    """Positions, in the flat output buffer, of this rank's local elements of `param`."""
    positions = torch.arange(offset, offset + param.numel(), dtype=torch.int64).view(param.shape)
    if layout is not None:  # the output holds the param in another row order: move positions with it
        positions = layout(positions)
    if not isinstance(param, DTensor):
        return positions.reshape(-1)
    # Sharding the position tensor with the param's own placements yields exactly its local positions.
    shard = distribute_tensor(positions, param.device_mesh, param.placements, src_data_rank=None)
    return shard.to_local().reshape(-1)


def aligned_offsets(numels: Sequence[int], element_size: int, align: int = ALIGN) -> list[int]:
    """Element offsets of tensors laid out back to back, each starting on an `align`-byte boundary."""
    step = max(align // element_size, 1)
    offsets = [0]
    for n in numels:
        offsets.append((offsets[-1] + n + step - 1) // step * step)
    return offsets


class ShardGatherer:
    """Preallocated, single-collective gather of a fixed list of (possibly sharded) params to rank 0."""

    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.Tensor]],
        group: dist.ProcessGroup | None = None,
        dst: int = 0,
        layouts: Sequence[Layout | None] | None = None,
    ) -> None:
        if not named_params:
            raise ValueError("no adapter parameters to gather: is the `lora` converter enabled?")
        dtypes = {p.dtype for _, p in named_params}
        if len(dtypes) != 1:
            raise ValueError(f"adapter params must share one dtype to be gathered together, got {dtypes}")
        self.names = [n for n, _ in named_params]
        self.shapes = [tuple(p.shape) for _, p in named_params]
        self.dtype = dtypes.pop()
        self.group = group
        self.dst = dst
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        # Flat views of the local shards, made once: FSDP2 keeps each sharded param's storage.
        self._locals = [_local(p).detach().reshape(-1) for _, p in named_params]
        device = self._locals[0].device
        layouts = layouts or [None] * len(named_params)
        # Outputs start on bucket-aligned boundaries, so the buffer is already a bucket's layout.
        offsets = aligned_offsets([p.numel() for _, p in named_params], self._locals[0].element_size())
        self.total_numel = offsets[-1]
        local_index = torch.cat([
            _global_flat_index(p, o, lay) for (_, p), o, lay in zip(named_params, offsets, layouts)
        ])
        self.local_numel = local_index.numel()
        self.max_local = self._max_over_ranks(self.local_numel, device)

        self._send = torch.empty(self.max_local, dtype=self.dtype, device=device)
        is_dst = self.rank == dst
        self._recv = torch.empty(self.world * self.max_local if is_dst else 0, dtype=self.dtype, device=device)
        # One extra slot at the end soaks up the padding of ranks whose shard is smaller. Zeros: the
        # alignment gaps between tensors are never written and must stay finite.
        self._full = torch.zeros(self.total_numel + 1 if is_dst else 0, dtype=self.dtype, device=device)
        self._index = self._gather_index(local_index.to(device), device)
        self.views = {
            name: self._full[offsets[i] : offsets[i] + math.prod(shape)].view(shape)
            for i, (name, shape) in enumerate(zip(self.names, self.shapes))
        } if is_dst else {}

    @property
    def nbytes(self) -> int:
        """Bytes of the gathered tensors (alignment padding excluded)."""
        return sum(math.prod(s) for s in self.shapes) * self._send.element_size()

    def _max_over_ranks(self, n: int, device: torch.device) -> int:
        if self.world == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def _gather_index(self, local_index: torch.Tensor, device: torch.device) -> torch.Tensor | None:
        padded = torch.full((self.max_local,), self.total_numel, dtype=torch.int64, device=device)
        padded[: local_index.numel()] = local_index
        if self.world == 1:
            return padded
        out = [torch.empty_like(padded) for _ in range(self.world)] if self.rank == self.dst else None
        dist.gather(padded, out, dst=self.dst, group=self.group)
        return torch.cat(out) if out is not None else None

    @torch.no_grad()
    def gather(self) -> dict[str, torch.Tensor] | None:
        """Collective. On rank `dst`: {name: full tensor} (views reused by the next call); else None."""
        torch.cat(self._locals, out=self._send[: self.local_numel])
        if self.world == 1:
            self._full.index_copy_(0, self._index, self._send)
            return self.views
        recv = list(self._recv.chunk(self.world)) if self.rank == self.dst else None
        dist.gather(self._send, recv, dst=self.dst, group=self.group)
        if self.rank != self.dst:
            return None
        self._full.index_copy_(0, self._index, self._recv)
        return self.views

    def all_finite(self) -> bool:
        """Rank `dst`: True when the last gathered tensors hold no NaN or Inf (one kernel, one sync)."""
        return bool(torch.isfinite(self._full[: self.total_numel]).all())
