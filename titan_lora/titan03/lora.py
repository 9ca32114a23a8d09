"""titan_lora's LoRA on torchtitan 0.3.0's config-tree protocol (prototype, branch tt03).

0.3.0 builds models from `Module.Config` trees and model converters rewrite the tree before the build
(`ModelConfigConverter.convert(model_config) -> Module.Config`, protocols/model.py:15-29). A module's
params are initialised from its config's `param_init` dict (protocols/module.py:160-209: a param with no
entry raises) and, when parallelized, placed by its config's `sharding_config.state_shardings`
(module.py:340-347: a param with no entry raises).

So the converter here replaces each target `Linear.Config` with the config of a LoRA subclass of the
linear's own class (`lora_linear_class`): that subclass is titan_lora's `lora_class(linear_cls)`
(LoRALayer mixin: same forward, same `lora_A`/`lora_B` params directly on the linear) plus a `Config`
and an `__init__` that create the adapters. Its config carries `param_init` entries for `lora_A`
(kaiming-uniform as peft, drawn from a per-module seeded generator so the values do not depend on the
sharding, as titan_lora's `init_adapters`) and `lora_B` (zeros). The adapters' `state_shardings` are
derived when the config is built, from the base weight's, because 0.3.0 fills sharding configs
*after* the converters have run (converters: models/llama3/__init__.py:381 in `model_registry`;
sharding: `update_from_config`, trainer.py:347):
colwise base (weight tp S(0)) -> A replicated, B S(0); rowwise (weight tp S(1)) -> A S(1), B replicated.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import spmd_types as spmd
import torch
import torch.nn as nn
from torchtitan.models.common.decoder_sharding import dense_param_placement
from torchtitan.models.common.attention import QKVLinear
from torchtitan.models.common.linear import Linear
from torchtitan.protocols.model import ModelConfigConverter
from torchtitan.protocols.module import Module
from torchtitan.protocols.sharding import ShardingConfig

from titan_lora.lora.layer import LoRALayer, fill_param, lora_class, lora_scale
from titan_lora.lora.targets import HEAD_NAMES, LeafNames
from titan_lora.titan03.model import split_qkv

logger = logging.getLogger(__name__)

# torchtitan leaf name -> HF/PEFT leaf name (users may write either), for both families.
LEAF_NAMES: LeafNames = {
    "wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj",
    "w1": "gate_proj", "w2": "down_proj", "w3": "up_proj",
}
# Config leaves that are not modules of their own: `wkv` is SplitQKVLinear's sharding template.
NOT_MODULES = frozenset({"wkv"})


def adapter_shardings(weight_layout) -> dict:  # noqa: ANN001 (SpmdLayout)
    """`state_shardings` entries for lora_A / lora_B, from the base weight's layout."""
    replicated = dense_param_placement(tp=spmd.R)
    if weight_layout == dense_param_placement(tp=spmd.S(0)):  # colwise: out rows sharded
        return {"lora_A": replicated, "lora_B": weight_layout}
    if weight_layout == dense_param_placement(tp=spmd.S(1)):  # rowwise: in columns sharded
        return {"lora_A": weight_layout, "lora_B": replicated}
    # Not TP-sharded (e.g. tp=R or I): adapters are placed as the weight.
    return {"lora_A": weight_layout, "lora_B": weight_layout}


def with_adapter_shardings(sharding: ShardingConfig | None) -> ShardingConfig | None:
    """`sharding` plus adapter placements derived from its `weight` entry (None stays None)."""
    if sharding is None or "weight" not in sharding.state_shardings:
        return sharding
    extra = adapter_shardings(sharding.state_shardings["weight"])
    return dataclasses.replace(sharding, state_shardings={**sharding.state_shardings, **extra})


@functools.cache
def lora_linear_class(linear_cls: type) -> type:
    """The buildable LoRA subclass of a 0.3.0 linear class (one per class).

    Bases: titan_lora's `lora_class(linear_cls)` = (LoRALayer, linear_cls), so `isinstance(m, LoRALayer)`,
    `lora_modules`, `adapter_params`, `freeze_base`, `adapters_disabled` work unchanged, and the module is
    still a `linear_cls` and a torchtitan `Module` (its init and protocol checks still see it).
    """
    base = lora_class(linear_cls)
    parent_config = linear_cls.Config

    class LoRALinear(base):  # type: ignore[valid-type, misc]
        @dataclass(kw_only=True, slots=True)
        class Config(parent_config):  # type: ignore[valid-type, misc]
            rank: int
            scale: float
            dropout: float = 0.0
            adapter_dtype: str = "float32"

            def build(self, **kwargs):  # noqa: ANN003, ANN201
                # Sharding is filled on this config after conversion, so the adapters' placements are
                # derived here, at build time, from whatever the base weight was given.
                instance = parent_config.build(self, **kwargs)
                if self.sharding_config is not None:
                    instance._sharding_config = with_adapter_shardings(self.sharding_config)
                return instance

        def __init__(self, config: Config) -> None:
            super().__init__(config)
            dtype = getattr(torch, config.adapter_dtype)
            # torch.empty follows the default device: meta under the trainer's `with torch.device("meta")`.
            self.lora_A = nn.Parameter(torch.empty(config.rank, config.in_features, dtype=dtype))
            self.lora_B = nn.Parameter(torch.empty(config.out_features, config.rank, dtype=dtype))
            self.scale = config.scale
            self.lora_dropout_p = config.dropout

    LoRALinear.__name__ = LoRALinear.__qualname__ = f"LoRA{linear_cls.__name__}"
    return LoRALinear


def init_lora_A(seed: int) -> Callable[[torch.Tensor], None]:
    """kaiming_uniform_(a=sqrt(5)) of the full A (bound 1/sqrt(in)), from a generator seeded by `seed`:
    the same values for any sharding (`fill_param` keeps this rank's shard)."""

    def init(param: torch.Tensor) -> None:
        gen = torch.Generator().manual_seed(seed)
        full = torch.empty(param.shape, dtype=torch.float32)
        bound = 1.0 / math.sqrt(param.shape[1])
        full.uniform_(-bound, bound, generator=gen)
        fill_param(param, full.to(param.dtype))

    return init


def init_zeros(param: torch.Tensor) -> None:
    with torch.no_grad():
        param.zero_()


@dataclass
class LoRASettings:
    """The `[lora]` fields the converter needs (titan_lora.config.LoRA has them all)."""

    rank: int = 16
    alpha: float = 32.0
    use_rslora: bool = False
    dropout: float = 0.0
    target_modules: list[str] | str = "all-linear"
    dtype: str = "float32"


class TitanLoRAConverter(ModelConfigConverter):
    """titan_lora's LoRA as a 0.3.0 `ModelConfigConverter`: target linears by leaf name (torchtitan or
    HF), never the head; q/k/v must be unfused (they are split so wk/wv are separate targets)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        lora: LoRASettings = field(default_factory=LoRASettings)
        seed: int = 0

    def __init__(self, config: Config, **kwargs) -> None:  # noqa: ANN003
        self.cfg = config.lora
        if self.cfg.rank <= 0:
            raise ValueError(f"LoRA rank must be positive, got {self.cfg.rank}")
        self.seed = config.seed
        self.targets: list[str] = []

    def _wanted(self, leaf: str) -> bool:
        targets = self.cfg.target_modules
        if leaf in NOT_MODULES:
            return False
        if targets == "all-linear":
            return leaf not in HEAD_NAMES
        to_titan = {hf: titan for titan, hf in LEAF_NAMES.items()}
        return leaf in {to_titan.get(t, t) for t in targets}

    def convert(self, model_config: Module.Config) -> Module.Config:
        # Split any 0.3.0 QKVLinear so that wk and wv are separate configs (separate targets).
        for _, qkv, parent, attr in list(model_config.traverse(Module.Config, recurse=True)):
            if type(qkv) is QKVLinear.Config:
                setattr(parent, attr, split_qkv(qkv))
        scale = lora_scale(self.cfg.rank, self.cfg.alpha, self.cfg.use_rslora)
        index = 0
        present: set[str] = set()
        for fqn, cfg, parent, attr in list(model_config.traverse(Linear.Config, recurse=False)):
            leaf = fqn.rsplit(".", 1)[-1]
            present.add(leaf)
            if not self._wanted(leaf):
                continue
            if cfg.param_init is None:
                raise ValueError(f"{fqn}: a LoRA target needs a param_init for its base weight")
            lora_cls = lora_linear_class(cfg._owner)
            new = lora_cls.Config(
                **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init},
                rank=self.cfg.rank,
                scale=scale,
                dropout=self.cfg.dropout,
                adapter_dtype=self.cfg.dtype,
            )
            # Seeds as titan_lora's init_adapters: (seed, index of the LoRA module in module order).
            # Config order = build order for these trees (wq, wk, wv, wo, w1, w2, w3 per layer).
            new.param_init = {
                **cfg.param_init,
                "lora_A": init_lora_A(self.seed * 1_000_003 + index),
                "lora_B": init_zeros,
            }
            index += 1
            if isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
            self.targets.append(fqn)
        if self.cfg.target_modules != "all-linear":
            to_titan = {hf: titan for titan, hf in LEAF_NAMES.items()}
            missing = sorted(t for t in self.cfg.target_modules if to_titan.get(t, t) not in present)
            if missing:
                raise ValueError(f"LoRA target_modules {missing} match no linear of this model")
        logger.info("LoRA rank %d on %d linears", self.cfg.rank, len(self.targets))
        return model_config


def build_lora_model_config(model_config: Module.Config, lora: LoRASettings, seed: int = 0) -> Module.Config:
    """Apply titan_lora's converter to an unbuilt 0.3.0 model config tree."""
    return TitanLoRAConverter.Config(lora=lora, seed=seed).build().convert(model_config)


__all__ = [
    "LEAF_NAMES",
    "LoRALayer",
    "LoRASettings",
    "TitanLoRAConverter",
    "adapter_shardings",
    "build_lora_model_config",
    "lora_linear_class",
]
