"""LoRA on a linear that stays the linear it was: a subclass of its own class, with the same `.weight`.

torchtitan's initialisers, shardings and state-dict adapters all read `linear.weight`, so a wrapper module would
break them. Instead the model is built with a subclass of the linear's very class (`lora_class`, built in by the
LoRA config-tree converter, `titan/lora_linear.py`) that owns two extra parameters, `lora_A` (rank x in) and
`lora_B` (out x rank). They exist from the meta build on, so TP and `fully_shard` place them like any other
param. Subclassing the linear's own class (not `nn.Linear`) keeps what torchtitan 0.3.0's `Linear` is besides:
a torchtitan `Module`, whose protocol checks and initialisers must still see it.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from titan_lora.lora.multi import MultiLoRALayer
from titan_lora.titan.moe import grouped_mm

# `lora_A` / `lora_B`, adapter k's `lora_A_<k>` / `lora_B_<k>` of a multi-adapter linear (`lora.multi`), and
# routed experts' `lora_A_gate_up_proj` ... `lora_B_down_proj` (`LoRAExperts`).
_ADAPTER_LEAF = re.compile(r"lora_[AB](_\d+|_gate_up_proj|_down_proj)?")


class LoRALayer:
    """The LoRA half of a LoRA linear: y = base(x) + scale * dropout(x) A^T B^T, mixed in before the
    linear's own class (`lora_class`)."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    scale: float
    # A float, not an nn.Dropout child: a child module would need its own config, param_init and sharding.
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


class LoRAExperts:
    """The LoRA half of routed experts (`titan_lora.titan.lora_experts`): each expert's projections of its rows
    plus scale * dropout(x) A_e^T B_e^T (one A for gate and up, as PEFT and vLLM), mixed in before the
    experts' own class."""

    scale: float
    lora_dropout_p: float
    training: bool

    def gate_up(self, x: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each expert's gate and up projections plus the halves of its gate/up update."""
        gate, up = super().gate_up(x, offsets)  # type: ignore[misc]
        update = self._update("gate_up_proj", x, offsets)
        return gate.add_(update[:, :gate.shape[1]], alpha=self.scale), up.add_(update[:, gate.shape[1]:],
                                                                              alpha=self.scale)

    def down(self, hidden: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Each expert's down projection plus its update."""
        return super().down(hidden, offsets).add_(  # type: ignore[misc]
            self._update("down_proj", hidden, offsets), alpha=self.scale)

    def _update(self, adapter: str, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        a = local_part(getattr(self, f"lora_A_{adapter}")).to(x.dtype)
        b = local_part(getattr(self, f"lora_B_{adapter}")).to(x.dtype)
        dropped = F.dropout(x, self.lora_dropout_p, self.training) if self.lora_dropout_p else x
        return grouped_mm(grouped_mm(dropped, a, offsets), b, offsets)


@functools.cache
def lora_experts_mixin(experts_cls: type) -> type:
    """The LoRA subclass of an experts class (one per class)."""
    if issubclass(experts_cls, LoRAExperts):
        return experts_cls
    return type(f"LoRA{experts_cls.__name__}", (LoRAExperts, experts_cls), {"__module__": __name__})


@functools.cache
def lora_class(linear_cls: type[nn.Linear]) -> type[nn.Linear]:
    """The LoRA subclass of `linear_cls` (one per class, so isinstance and torch.compile see one type)."""
    if issubclass(linear_cls, LoRALayer):
        return linear_cls
    return type(f"LoRA{linear_cls.__name__}", (LoRALayer, linear_cls), {"__module__": __name__})


def lora_scale(rank: int, alpha: float, use_rslora: bool) -> float:
    """The LoRA scaling factor: alpha / rank, or alpha / sqrt(rank) with rsLoRA."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor`: a DTensor's local shard, a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def clean_fqn(name: str) -> str:
    """A parameter or module name without activation checkpointing's wrapper segment (torchtitan 0.3.0
    compiles blocks in place, so compile adds none)."""
    return name.replace("_checkpoint_wrapped_module.", "")


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALayer | LoRAExperts]]:
    """The LoRA linears and LoRA experts of `model` with their clean qualified names, in module order."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALayer | LoRAExperts):
            yield clean_fqn(name), module


def is_adapter_param(name: str) -> bool:
    """True for a parameter name that belongs to an adapter (`...lora_A` / `...lora_B`, `...lora_A_<k>`)."""
    return _ADAPTER_LEAF.fullmatch(name.rsplit(".", 1)[-1]) is not None


def adapter_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The adapter parameters of `model`, in one fixed order (the same on every rank)."""
    return [(clean_fqn(n), p) for n, p in model.named_parameters() if is_adapter_param(n)]


def freeze_base(model: nn.Module) -> None:
    """Make only the adapter parameters trainable."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_param(name))


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run the base model (every adapter's scale set to 0; a K-adapter linear adds no adapter's delta), e.g. for a
    KL reference, with no copy."""
    modules = [m for _, m in lora_modules(model)]
    scales = [m.scale for m in modules]
    multi = [m for m in model.modules() if isinstance(m, MultiLoRALayer)]
    adapter_scales = [m.adapter_scales for m in multi]
    for m in modules:
        m.scale = 0.0
    for m in multi:  # no adapter targets it while disabled: the base alone, on every row
        m.adapter_scales = {}
    try:
        yield
    finally:
        for m, s in zip(modules, scales):
            m.scale = s
        for m, held in zip(multi, adapter_scales):
            m.adapter_scales = held
