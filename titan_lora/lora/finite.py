"""The collective NaN/Inf check of the adapter, run after every optimizer step and before every save."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from titan_lora.lora.layer import adapter_params, local_part


class NonFiniteAdapterError(RuntimeError):
    """The adapter holds NaN or Inf values; raised on every rank."""


def _first_local_nonfinite(tensors: list[torch.Tensor]) -> int:
    """Index of the first tensor holding NaN/Inf, or len(tensors)."""
    if not tensors:
        return 0
    # One fused pass and one host sync: NaN and Inf propagate into the norm. An overflowing norm
    # of finite values would also read as Inf, so only those candidates are checked element-wise.
    norms = torch.stack([n.float() for n in torch._foreach_norm(tensors, 2)])
    suspects = (~torch.isfinite(norms)).nonzero().flatten().tolist()
    return next((i for i in suspects if not bool(torch.isfinite(tensors[i]).all())), len(tensors))


def first_nonfinite_adapter(model: nn.Module) -> str | None:
    """Collective: the name of the first adapter tensor that is non-finite on any rank, else None.

    Every rank gets the same answer (one all_reduce of the local first index), so every rank takes
    the same branch afterwards.
    """
    params = adapter_params(model)
    local = _first_local_nonfinite([local_part(p).detach() for _, p in params])
    device = params[0][1].device if params else torch.device("cpu")
    index = torch.tensor([local], dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(index, op=dist.ReduceOp.MIN)
    first = int(index.item())
    return params[first][0] if first < len(params) else None

