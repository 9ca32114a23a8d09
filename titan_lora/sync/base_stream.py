"""The base weights as a collective stream in HF naming: rank 0 gets one full tensor at a time."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from titan_lora.lora.layer import clean_fqn, is_adapter_param

BaseStream = Callable[..., Iterator[tuple[str, torch.Tensor]]]
"""`stream()` yields every base weight, `stream(only)` those whose HF names are in `only`."""


def base_weights_source(model: nn.Module, sd_adapter, tied_embeddings: bool) -> BaseStream:  # noqa: ANN001
    """A collective generator of the base weights in HF naming (all, or those named in `only`): rank 0 gets
    one full tensor at a time, the other ranks keep nothing (they take part in each gather and drop it).

    Every rank must run it to the end in the same order (each `full_tensor` is a collective). It runs
    once per engine incarnation, so a per-parameter gather is fine here; the per-step adapter path is
    the single-collective one.
    """

    def stream(only: Collection[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        for name, param in model.named_parameters():
            if is_adapter_param(name):
                continue
            hf_name = hf_name_of(sd_adapter, clean_fqn(name), param)  # same on every rank: no collective
            if hf_name is None or (tied_embeddings and hf_name == "lm_head.weight"):
                continue  # the engine ties lm_head to the embedding itself
            if only is not None and hf_name not in only:
                continue  # `only` is the same on every rank: the same gathers run everywhere
            full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
            if rank0:
                # to_hf handles one tensor at a time: it renames and permutes wq/wk rows per key.
                (_, hf), = sd_adapter.to_hf({clean_fqn(name): full}).items()
                yield hf_name, hf
            del full  # other ranks: nothing kept

    return stream


def hf_name_of(sd_adapter, name: str, param: torch.Tensor) -> str | None:  # noqa: ANN001
    """The HF name `name` maps to (None: the engine has no such weight), found on a meta tensor."""
    mapped = sd_adapter.to_hf({name: torch.empty(param.shape, device="meta")})
    return next(iter(mapped), None)
