"""K LoRA adapters per linear on torchtitan 0.3.0's config-tree protocol: the converter that rewrites the
linears any adapter targets into configs of a K-adapter subclass of the linear's own class.

The multi-adapter twin of `lora_linear` (same seam, same rules): adapter k's parameters `lora_A_<k>` /
`lora_B_<k>` exist only on the linears k targets, each initialised as the one-adapter build initialises
`lora_A` / `lora_B` with adapter k's own seed (kaiming-uniform A from a generator seeded by (seed_k, index of
the linear among those k targets, in build order), zero B), and placed by shardings derived from the base
weight's as `lora_A` / `lora_B` are (`adapter_shardings`). titan_lora's K-adapter half (`multi_lora_class`,
the `MultiLoRALayer` mixin) comes in as an argument.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
from torchtitan.models.common.linear import Linear
from torchtitan.protocols.module import Module
from torchtitan.protocols.sharding import ShardingConfig

from titan_lora.titan.lora_linear import adapter_shardings, built_position, init_lora_A, init_zeros, linear_names

__all__ = ["AdapterTargets", "MultiLoRAConfigConverter", "multi_lora_linear_class"]


def _with_multi_adapter_shardings(sharding: ShardingConfig | None, adapters: Sequence[int]) -> ShardingConfig | None:
    """`sharding` plus `lora_A_<k>` / `lora_B_<k>` placements for each of `adapters`, from its `weight` entry."""
    if sharding is None or "weight" not in sharding.state_shardings:
        return sharding
    one = adapter_shardings(sharding.state_shardings["weight"])
    extra = {f"{leaf}_{k}": placement for k in adapters for leaf, placement in one.items()}
    return dataclasses.replace(sharding, state_shardings={**sharding.state_shardings, **extra})


@functools.cache
def multi_lora_linear_class(linear_cls: type, multi_class: Callable[[type], type]) -> type:
    """The buildable K-adapter subclass of a 0.3.0 linear class: `multi_class(linear_cls)` plus a `Config`
    with each adapter's rank and scale (None where the adapter does not target this linear) and an
    `__init__` that creates the adapters' parameters (see `lora_linear_class` for why a new `Config`)."""
    base = multi_class(linear_cls)
    parent_config = linear_cls.Config

    class MultiLoRALinear(base):  # type: ignore[valid-type, misc]
        @dataclass(kw_only=True, slots=True)
        class Config(parent_config):  # type: ignore[valid-type, misc]
            ranks: tuple[int | None, ...]
            scales: tuple[float | None, ...]
            dropout: float = 0.0
            adapter_dtype: str = "float32"

            def build(self, **kwargs) -> nn.Module:  # noqa: ANN003
                instance = parent_config.build(self, **kwargs)
                if self.sharding_config is not None:
                    present = [k for k, rank in enumerate(self.ranks) if rank is not None]
                    instance._sharding_config = _with_multi_adapter_shardings(self.sharding_config, present)
                return instance

        def __init__(self, config: Config) -> None:
            super().__init__(config)
            dtype = getattr(torch, config.adapter_dtype)
            self.num_adapters = len(config.ranks)
            self.adapter_scales = {k: scale for k, (rank, scale) in enumerate(zip(config.ranks, config.scales))
                                   if rank is not None}
            self.lora_dropout_p = config.dropout
            for k in self.adapter_scales:  # torch.empty follows the default device: meta in a meta build
                setattr(self, f"lora_A_{k}", nn.Parameter(torch.empty(config.ranks[k], config.in_features,
                                                                      dtype=dtype)))
                setattr(self, f"lora_B_{k}", nn.Parameter(torch.empty(config.out_features, config.ranks[k],
                                                                      dtype=dtype)))

    MultiLoRALinear.__name__ = MultiLoRALinear.__qualname__ = f"MultiLoRA{linear_cls.__name__}"
    return MultiLoRALinear


@dataclass(frozen=True)
class AdapterTargets:
    """One adapter of the converter: which linears it adapts (from the tree's linear names, in build order),
    its rank, scale and seed."""

    select: Callable[[Sequence[str]], Sequence[str]]
    rank: int
    scale: float
    seed: int


@dataclass
class MultiLoRAConfigConverter:
    """Rewrites every linear that at least one of `adapters` selects into a K-adapter linear."""

    multi_class: Callable[[type], type]
    adapters: Sequence[AdapterTargets]
    dropout: float = 0.0
    dtype: str = "float32"
    targets: list[list[str]] = dataclasses.field(default_factory=list)
    """Each adapter's adapted linears, in build order (filled by the call)."""

    def __call__(self, model_config: Module.Config) -> Module.Config:
        names = linear_names(model_config)
        wanted = [set(adapter.select(names)) for adapter in self.adapters]
        found = [entry for entry in model_config.traverse(Linear.Config, recurse=False)
                 if any(entry[0] in w for w in wanted)]
        index = [0] * len(self.adapters)
        self.targets = [[] for _ in self.adapters]
        for fqn, cfg, parent, attr in sorted(found, key=lambda entry: built_position(entry[0])):
            if cfg.param_init is None:
                raise ValueError(f"{fqn}: a LoRA target needs a param_init for its base weight")
            on = [fqn in w for w in wanted]
            new = multi_lora_linear_class(cfg._owner, self.multi_class).Config(
                **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init},
                ranks=tuple(a.rank if here else None for a, here in zip(self.adapters, on)),
                scales=tuple(a.scale if here else None for a, here in zip(self.adapters, on)),
                dropout=self.dropout, adapter_dtype=self.dtype)
            init = dict(cfg.param_init)
            for k, adapter in enumerate(self.adapters):
                if on[k]:
                    init[f"lora_A_{k}"] = init_lora_A(adapter.seed * 1_000_003 + index[k])
                    init[f"lora_B_{k}"] = init_zeros
                    index[k] += 1
                    self.targets[k].append(fqn)
            new.param_init = init
            if isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
        return model_config
