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
            hf_names = [n for n in hf_names_of(sd_adapter, clean_fqn(name), param)  # same on every rank
                        if not (tied_embeddings and n == "lm_head.weight")]  # the engine ties it itself
            if only is not None:
                hf_names = [n for n in hf_names if n in only]  # `only` is the same on every rank
            if not hf_names:
                continue  # the same gathers run everywhere
            full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
            if rank0:
                # to_hf renames, permutes wq/wk rows per key and splits stacked experts into one per expert.
                for hf_name, hf in sd_adapter.to_hf({clean_fqn(name): full}).items():
                    if hf_name in hf_names:
                        yield hf_name, hf
            del full  # other ranks: nothing kept

    return stream


def hf_names_of(sd_adapter, name: str, param: torch.Tensor) -> list[str]:  # noqa: ANN001
    """The HF names weight `name` maps to, found on a meta tensor: one, or one per expert for a stacked
    expert weight; none where the engine has no such weight."""
    return list(sd_adapter.to_hf({name: torch.empty(param.shape, device="meta")}))
