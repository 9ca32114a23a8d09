"""Read each rank's own slice of an HF checkpoint's tensors, never a whole sharded tensor.

A parameter's slice is its local shard's box in the global tensor (FSDP and TP `Shard`, FSDP2's strided
shard over TP, `Replicate`, uneven splits, empty shards; a plain tensor is one whole box). Rows the
state-dict adapter reorders (`row_maps`: Llama's q/k, interleaved for its RoPE) are read as the block of
HF rows covering the box's rows (the heads it cuts), then picked in torchtitan's order.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

Box = tuple[slice, ...]


def local_box(param: torch.Tensor) -> Box:
    """The global index ranges of `param`'s local shard (the whole tensor for a plain tensor)."""
    if not isinstance(param, DTensor):
        return tuple(slice(0, n) for n in param.shape)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    local = tuple(param.to_local().shape)
    if tuple(shape) != local:  # a placement whose shard is not one contiguous box
        raise ValueError(f"cannot read a slice for a shard of placements {param.placements}: its box "
                         f"{tuple(shape)} is not its local shape {local}; the load supports FSDP/TP "
                         "placements whose shard is one contiguous block of each dim")
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


class SliceReader:
    """Slices of the tensors of safetensors files, read one at a time; counts the bytes it reads."""

    def __init__(self, files: Mapping[str, Path]) -> None:
        self.files = files
        self.bytes_read = 0

    def read(self, name: str, box: Box) -> torch.Tensor:
        """`name`'s elements in `box` (the file is opened per read: its mapped pages go with the slice)."""
        with safe_open(str(self.files[name]), framework="pt") as st:
            part = st.get_slice(name)[box]
        self.bytes_read += part.numel() * part.element_size()
        return part

    def read_rows(self, name: str, box: Box, hf_rows: torch.Tensor | None) -> torch.Tensor:
        """`name`'s elements in `box`, row i being HF row `hf_rows[i]` (None: HF row i), read as the one
        block of HF rows covering them (for Llama's q/k: the heads the box cuts)."""
        want = hf_rows[box[0]] if hf_rows is not None else None
        if want is None or want.numel() == 0:  # unmapped, or an empty shard (an uneven FSDP split's last)
            return self.read(name, box)
        lo, hi = int(want.min()), int(want.max()) + 1
        return self.read(name, (slice(lo, hi), *box[1:]))[want.long() - lo]
