"""The base weights' digests as the trainer holds them, computed over each rank's own shards: no weight byte
moves, only two int64 lanes per tensor in one all-reduce.

An engine digests the same tensors in HF layout (`transfer.digest.tensor_digest`); equal digests prove
it serves the trainer's base, and a mismatch names the tensors to send (docs/internals.md, "The base:
verified, not pushed").
"""

from __future__ import annotations

import math
import re

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from titan_lora.export.peft import PeftLayout, hf_rope_permute
from titan_lora.lora.layer import clean_fqn, is_adapter_param, local_part
from titan_lora.sync.base_stream import hf_names_of
from titan_lora.sync.gather import sends_its_part
from titan_lora.transfer.digest import as_matrix, block_digest, fold


def _hf_rows(layout: PeftLayout, name: str, rows: int) -> torch.Tensor:
    """The HF row of each of the trainer's rows of weight `name`: the family's RoPE permutation (the one
    its lora_B rows get) where the layout names the module, else the same row."""
    module = re.sub(r"\d+", "{}", name.removesuffix(".weight"), count=1)
    rope = layout.rope.get(module)
    if rope is None:
        return torch.arange(rows, dtype=torch.int64)
    order = hf_rope_permute(torch.arange(rows, dtype=torch.int64).view(rows, 1), rope.n_heads, rope.head_dim)
    hf_row = torch.empty(rows, dtype=torch.int64)
    hf_row[order.reshape(-1)] = torch.arange(rows, dtype=torch.int64)
    return hf_row


def _local_index(param: torch.Tensor, full: torch.Tensor, dim: int) -> torch.Tensor:
    """`full` (the global index along `dim`, laid out as a [n, 1] or [1, n] slab) sharded as `param` is,
    the other dimension's placements replaced by Replicate: this rank's indices along `dim`."""
    if not isinstance(param, DTensor):
        return full.reshape(-1)
    # Any placement with a `dim` shards (Shard, and FSDP2's _StridedShard under TP, which is_shard() denies).
    placements = [Replicate() if getattr(p, "dim", dim) != dim else p for p in param.placements]
    shard = distribute_tensor(full, param.device_mesh, placements, src_data_rank=None)
    return shard.to_local().reshape(-1)


def _partial(hf_name: str, titan_name: str, param: torch.Tensor, layout: PeftLayout,
             dtype: torch.dtype) -> torch.Tensor:
    """This rank's two lanes of `hf_name`'s digest (zeros where another rank holds the same elements)."""
    local = as_matrix(local_part(param).detach())
    if not sends_its_part(param, 0) or local.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=local.device)
    rows = param.shape[0] if param.dim() else 1
    width = math.prod(param.shape[1:])
    hf_row = _hf_rows(layout, titan_name, rows) if param.dim() == 2 else torch.arange(rows)
    device = local.device
    row_index = _local_index(param, hf_row.view(rows, *([1] * max(param.dim() - 1, 0))).to(device), 0)
    if param.dim() == 2:
        col_index = _local_index(param, torch.arange(width, device=device).view(1, width), 1)
    else:  # norms (1-D): one column; higher ranks are not sharded past dim 0 here
        col_index = torch.arange(local.shape[1], device=device)
    return block_digest(hf_name, local.to(dtype), row_index, col_index)


def _expert_partials(hf_names: list[str], param: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """This rank's two lanes of each expert's digest of a stacked expert weight (experts, out, in): a rank
    holds whole experts (FSDP shards dim 0), zeros for the others'."""
    local = local_part(param).detach()
    lanes = [torch.zeros(2, dtype=torch.int64, device=local.device) for _ in hf_names]
    if not sends_its_part(param, 0) or local.numel() == 0:
        return lanes
    experts_here = _local_index(param, torch.arange(len(hf_names), device=local.device).view(-1, 1, 1), 0)
    rows, cols = (torch.arange(n, device=local.device) for n in local.shape[1:])
    for j, expert in enumerate(experts_here.tolist()):
        lanes[expert] = block_digest(hf_names[expert], local[j].to(dtype), rows, cols)
    return lanes


def base_digests(model: nn.Module, sd_adapter, layout: PeftLayout, tied_embeddings: bool,  # noqa: ANN001
                 dtype: torch.dtype | None = None) -> dict[str, str]:
    """Collective: HF name -> digest of every base weight the engine holds (a tied `lm_head` is the
    embedding's), taken in `dtype` (the engine's; None: the trainer's own), on every rank."""
    names, parts = [], []
    for name, param in model.named_parameters():
        if is_adapter_param(name):
            continue
        titan_name = clean_fqn(name)
        hf_names = hf_names_of(sd_adapter, titan_name, param)
        if len(hf_names) > 1:  # a stacked expert weight: one HF tensor per expert
            names.extend(hf_names)
            parts.extend(_expert_partials(hf_names, param, dtype or param.dtype))
            continue
        if not hf_names or (tied_embeddings and hf_names[0] == "lm_head.weight"):
            continue
        names.append(hf_names[0])
        parts.append(_partial(hf_names[0], titan_name, param, layout, dtype or param.dtype))
    if not parts:
        return {}
    lanes = torch.stack(parts)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(lanes)  # sums of values below 2^31: far from int64's range on any world size
    return {name: fold(lane) for name, lane in zip(names, lanes.cpu())}
