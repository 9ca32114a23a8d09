"""LoRA on a linear that stays the linear it was: same object, same class family, same `.weight`.

torchtitan's `init_weights`, TP plans, float8 converters and state-dict adapters all read
`linear.weight`, so a wrapper module would break them. Instead the linear's class is swapped for a
subclass of that very class (`lora_class`) that owns two extra parameters, `lora_A` (rank x in) and
`lora_B` (out x rank). They are created on the module before sharding, so `fully_shard` turns them into
DTensors like any other param. Subclassing the linear's own class (not `nn.Linear`) keeps whatever base the
framework's linear has: torchtitan 0.3.0's `Linear` is also a torchtitan `Module`, whose protocol checks and
initialisers must still see it.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, distribute_tensor

ADAPTER_SUFFIXES = ("lora_A", "lora_B")


class LoRALayer:
    """The LoRA half of a LoRA linear: y = base(x) + scale * dropout(x) A^T B^T, mixed in before the
    linear's own class (`lora_class`)."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    scale: float
    # A float, not an nn.Dropout child: TP styles visit every child of a linear and read `.weight`.
    lora_dropout_p: float
    training: bool  # nn.Module's, from the linear's class after this mixin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Base projection plus the scaled low-rank path."""
        base = super().forward(x)  # type: ignore[misc]  (the linear's own: F.linear for an nn.Linear)
        dropped = F.dropout(x, self.lora_dropout_p, self.training) if self.lora_dropout_p else x
        # Adapters kept out of FSDP (`[lora] replicate_adapters`) miss its cast to the compute dtype.
        update = F.linear(F.linear(dropped, self.lora_A.to(x.dtype)), self.lora_B.to(x.dtype))
        # In place, with the scale as add's alpha: one elementwise kernel and no extra activation
        # (F.linear's backward does not need its output, so autograd allows it).
        return base.add_(update, alpha=self.scale)


@functools.cache
def lora_class(linear_cls: type[nn.Linear]) -> type[nn.Linear]:
    """The LoRA subclass of `linear_cls` (one per class, so isinstance and torch.compile see one type)."""
    if issubclass(linear_cls, LoRALayer):
        return linear_cls
    return type(f"LoRA{linear_cls.__name__}", (LoRALayer, linear_cls), {"__module__": __name__})


LoRALinear = lora_class(nn.Linear)
"""The LoRA subclass of a plain `nn.Linear` (torchtitan 0.2.2's linears are plain ones)."""


def lora_scale(rank: int, alpha: float, use_rslora: bool) -> float:
    """The LoRA scaling factor: alpha / rank, or alpha / sqrt(rank) with rsLoRA."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def convert_linear(
    linear: nn.Linear, rank: int, scale: float, dropout: float, dtype: torch.dtype
) -> LoRALayer:
    """Turn `linear` into its class's LoRA subclass in place (same object, same `.weight`/`.bias`)."""
    device = linear.weight.device
    linear.__class__ = lora_class(type(linear))
    lora = linear  # the same object, now a LoRALayer
    lora.lora_A = nn.Parameter(torch.empty(rank, linear.in_features, device=device, dtype=dtype))
    lora.lora_B = nn.Parameter(torch.empty(linear.out_features, rank, device=device, dtype=dtype))
    lora.scale = scale
    lora.lora_dropout_p = dropout
    return lora  # type: ignore[return-value]


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor`: a DTensor's local shard, a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def clean_fqn(name: str) -> str:
    """A parameter or module name without activation checkpointing's wrapper segment (torchtitan 0.3.0
    compiles blocks in place, so compile adds none)."""
    return name.replace("_checkpoint_wrapped_module.", "")


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALayer]]:
    """The LoRA linears of `model` with their clean qualified names, in module order."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALayer):
            yield clean_fqn(name), module


def is_adapter_param(name: str) -> bool:
    """True for a parameter name that belongs to an adapter (`...lora_A` / `...lora_B`)."""
    return name.rsplit(".", 1)[-1] in ADAPTER_SUFFIXES


def adapter_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The adapter parameters of `model`, in one fixed order (the same on every rank)."""
    return [(clean_fqn(n), p) for n, p in model.named_parameters() if is_adapter_param(n)]


def freeze_base(model: nn.Module) -> None:
    """Make only the adapter parameters trainable."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_param(name))


def fill_param(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into `param`, keeping only this rank's shard if it is a DTensor."""
    with torch.no_grad():
        if isinstance(param, DTensor):
            # src_data_rank=None: every rank holds `full`, so each slices its own shard, no comm.
            shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(full)


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int = 0) -> None:
    """Kaiming-uniform A and zero B, so that step 0 equals the base model.

    The full A of each module is drawn from a generator seeded by (seed, module index), so the
    result is the same for any number of ranks and any sharding.
    """
    for index, (_, module) in enumerate(lora_modules(model)):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
        full_a = torch.empty(module.lora_A.shape, dtype=torch.float32)
        bound = 1.0 / math.sqrt(module.in_features)  # kaiming_uniform_ with a=sqrt(5)
        full_a.uniform_(-bound, bound, generator=gen)
        fill_param(module.lora_A, full_a.to(module.lora_A.dtype))
        fill_param(module.lora_B, torch.zeros(module.lora_B.shape, dtype=module.lora_B.dtype))


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run the base model (every adapter's scale set to 0), e.g. for a KL reference, with no copy."""
    modules = [m for _, m in lora_modules(model)]
    scales = [m.scale for m in modules]
    for m in modules:
        m.scale = 0.0
    try:
        yield
    finally:
        for m, s in zip(modules, scales):
            m.scale = s
