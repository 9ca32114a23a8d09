"""LoRA linears on torchtitan 0.3.0's config-tree protocol: a model converter that rewrites the targeted
`Linear.Config`s of an unbuilt model into configs of a LoRA subclass of the linear's own class.

Part of the seam (`titan_lora.titan`), the bottom layer: titan_lora's LoRA half (the `LoRALayer` mixin, as
`lora_class(linear_cls)`) and its target selection come in as arguments. 0.3.0 initialises a module's params
from its config's `param_init` (protocols/module.py:160-209: a param with no entry raises) and places them by
its `sharding_config.state_shardings` (module.py:340-347: likewise), so the LoRA config carries
- `param_init` for `lora_A` (kaiming-uniform as peft, drawn whole from a generator seeded per module, so the
  values do not depend on the sharding: the values titan_lora gave on 0.2.2) and `lora_B` (zeros);
- adapter shardings derived at build time from the base weight's (0.3.0 fills sharding configs after the
  converters ran, in `update_from_config`): colwise base (tp S(0)) -> A replicated, B S(0); rowwise
  (tp S(1)) -> A S(1), B replicated.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import spmd_types as spmd
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.models.common.decoder_sharding import dense_param_placement
from torchtitan.models.common.linear import Linear
from torchtitan.protocols.module import Module
from torchtitan.protocols.sharding import ShardingConfig

from titan_lora.titan.decoder import split_all_qkv

__all__ = ["LoRAConfigConverter", "adapter_shardings", "fill_param", "linear_names", "lora_linear_class"]

logger = logging.getLogger(__name__)

NOT_MODULES = frozenset({"wkv"})
"""Config leaves that are no module of their own: `wkv` is `SplitQKVLinear`'s sharding template."""


def adapter_shardings(weight_layout) -> dict:  # noqa: ANN001 (an SpmdLayout)
    """`state_shardings` entries for lora_A / lora_B, from the base weight's layout."""
    replicated = dense_param_placement(tp=spmd.R)
    if weight_layout == dense_param_placement(tp=spmd.S(0)):  # colwise: out rows sharded
        return {"lora_A": replicated, "lora_B": weight_layout}
    if weight_layout == dense_param_placement(tp=spmd.S(1)):  # rowwise: in columns sharded
        return {"lora_A": weight_layout, "lora_B": replicated}
    return {"lora_A": weight_layout, "lora_B": weight_layout}  # not TP-sharded: placed as the weight


def with_adapter_shardings(sharding: ShardingConfig | None) -> ShardingConfig | None:
    """`sharding` plus adapter placements derived from its `weight` entry (None stays None)."""
    if sharding is None or "weight" not in sharding.state_shardings:
        return sharding
    extra = adapter_shardings(sharding.state_shardings["weight"])
    return dataclasses.replace(sharding, state_shardings={**sharding.state_shardings, **extra})


@functools.cache
def lora_linear_class(linear_cls: type, lora_class: Callable[[type], type]) -> type:
    """The buildable LoRA subclass of a 0.3.0 linear class: `lora_class(linear_cls)` (titan_lora's mixin
    before the linear's own class) plus a `Config` with the adapter fields and an `__init__` that creates
    the adapters. A new `Config` is needed: `Configurable.__init_subclass__` wires `build()` to the class
    whose body defines it (config/configurable.py:162-180)."""
    base = lora_class(linear_cls)
    parent_config = linear_cls.Config

    class LoRALinear(base):  # type: ignore[valid-type, misc]
        @dataclass(kw_only=True, slots=True)
        class Config(parent_config):  # type: ignore[valid-type, misc]
            rank: int
            scale: float
            dropout: float = 0.0
            adapter_dtype: str = "float32"

            def build(self, **kwargs) -> nn.Module:  # noqa: ANN003
                instance = parent_config.build(self, **kwargs)
                if self.sharding_config is not None:
                    instance._sharding_config = with_adapter_shardings(self.sharding_config)
                return instance

        def __init__(self, config: Config) -> None:
            super().__init__(config)
            dtype = getattr(torch, config.adapter_dtype)
            # torch.empty follows the default device: meta under `with torch.device("meta")`.
            self.lora_A = nn.Parameter(torch.empty(config.rank, config.in_features, dtype=dtype))
            self.lora_B = nn.Parameter(torch.empty(config.out_features, config.rank, dtype=dtype))
            self.scale = config.scale
            self.lora_dropout_p = config.dropout

    LoRALinear.__name__ = LoRALinear.__qualname__ = f"LoRA{linear_cls.__name__}"
    return LoRALinear


def fill_param(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into `param`, keeping only this rank's shard if it is a DTensor."""
    with torch.no_grad():
        if isinstance(param, DTensor):  # every rank holds `full`: each slices its own shard, no comm
            param.to_local().copy_(distribute_tensor(full, param.device_mesh, param.placements,
                                                     src_data_rank=None).to_local())
        else:
            param.copy_(full)


def init_lora_A(seed: int) -> Callable[[torch.Tensor], None]:  # noqa: N802 (PEFT names it lora_A)
    """kaiming_uniform_(a=sqrt(5)) of the full A (bound 1/sqrt(in)), from a generator seeded by `seed`."""
    def init(param: torch.Tensor) -> None:
        full = torch.empty(param.shape, dtype=torch.float32)
        full.uniform_(-1.0 / math.sqrt(param.shape[1]), 1.0 / math.sqrt(param.shape[1]),
                      generator=torch.Generator().manual_seed(seed))
        fill_param(param, full.to(param.dtype))
    return init


def init_zeros(param: torch.Tensor) -> None:
    with torch.no_grad():
        param.zero_()


BUILT_ORDER = ("tok_embeddings", "layers", "norm", "lm_head")
"""The order `Decoder.__init__` builds its children in (its config declares lm_head first): a module's index,
and so its adapter's seed, follows the built model's module order, as titan_lora's numbering always did."""


def built_position(fqn: str) -> int:
    """Where the module at `fqn` comes in the built model's module order (`BUILT_ORDER` of its top level)."""
    top = fqn.split(".", 1)[0]
    return BUILT_ORDER.index(top) if top in BUILT_ORDER else len(BUILT_ORDER)


def linear_names(model_config: Module.Config) -> list[str]:
    """The qualified names of the linears a config tree builds, in build order (q/k/v split first)."""
    split_all_qkv(model_config)
    return [fqn for fqn, *_ in model_config.traverse(Linear.Config, recurse=False)
            if fqn.rsplit(".", 1)[-1] not in NOT_MODULES]


@dataclass
class LoRAConfigConverter:
    """Rewrites the linears `select` picks (from the tree's linear names, in build order) into LoRA linears.

    `lora_class` is titan_lora's `lora_class` (its `LoRALayer` mixin); `seed` seeds the adapters as
    titan_lora always did: (seed, index of the LoRA module in the built model's order)."""

    lora_class: Callable[[type], type]
    select: Callable[[Sequence[str]], Sequence[str]]
    rank: int
    scale: float
    dropout: float = 0.0
    dtype: str = "float32"
    seed: int = 0
    targets: list[str] = dataclasses.field(default_factory=list)

    def __call__(self, model_config: Module.Config) -> Module.Config:
        wanted = set(self.select(linear_names(model_config)))
        found = [entry for entry in model_config.traverse(Linear.Config, recurse=False) if entry[0] in wanted]
        index = 0
        self.targets = []
        for fqn, cfg, parent, attr in sorted(found, key=lambda entry: built_position(entry[0])):
            if cfg.param_init is None:
                raise ValueError(f"{fqn}: a LoRA target needs a param_init for its base weight")
            new = lora_linear_class(cfg._owner, self.lora_class).Config(
                **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init},
                rank=self.rank, scale=self.scale, dropout=self.dropout, adapter_dtype=self.dtype)
            new.param_init = {**cfg.param_init, "lora_A": init_lora_A(self.seed * 1_000_003 + index),
                              "lora_B": init_zeros}
            index += 1
            if isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
            self.targets.append(fqn)
        return model_config
