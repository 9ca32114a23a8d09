"""LoRA on routed experts on torchtitan 0.3.0's config-tree protocol: a converter that rewrites every `Experts`
config of an unbuilt model into a config of a LoRA subclass.

Part of the seam (`titan_lora.titan`), the twin of `lora_linear`: titan_lora's LoRA half (the `LoRAExperts`
mixin, as `experts_mixin`) comes in as an argument. Each expert e gets its own rank-r adapters, laid out as
PEFT 0.21 adapts HF's fused expert parameters (`target_parameters`, one LoRA per 3-D parameter) and as vLLM 0.32
unpacks them: one on the fused gate/up projection (its A shared by gate and up, its B's first `hidden` rows
gate's, the rest up's) and one on down. Stacked as the base weights: `lora_A_gate_up_proj` (experts, r, dim),
`lora_B_gate_up_proj` (experts, 2 hidden, r), `lora_A_down_proj` (experts, r, hidden), `lora_B_down_proj`
(experts, dim, r). A is kaiming-uniform per expert (bound 1/sqrt(in), drawn whole from a generator seeded per
module, so values do not depend on the sharding), B zero. FSDP shards them over the experts as it shards the
base weights.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
from torchtitan.protocols.module import Module

from titan_lora.titan.lora_linear import fill_param, init_zeros
from titan_lora.titan.moe import Experts

__all__ = ["EXPERT_ADAPTERS", "ExpertsLoRAConverter", "experts_names", "lora_experts_class"]

EXPERT_ADAPTERS = ("gate_up_proj", "down_proj")
"""The adapters of one expert, named as HF's fused expert parameters (`mlp.experts.gate_up_proj`)."""


def init_expert_lora_A(seed: int) -> Callable[[torch.Tensor], None]:  # noqa: N802 (PEFT names it lora_A)
    """kaiming_uniform_(a=sqrt(5)) of every expert's A (bound 1/sqrt(in)), from a generator seeded by `seed`."""
    def init(param: torch.Tensor) -> None:
        full = torch.empty(param.shape, dtype=torch.float32)
        bound = 1.0 / math.sqrt(param.shape[-1])
        full.uniform_(-bound, bound, generator=torch.Generator().manual_seed(seed))
        fill_param(param, full.to(param.dtype))
    return init


@functools.cache
def lora_experts_class(experts_cls: type, experts_mixin: Callable[[type], type]) -> type:
    """The buildable LoRA subclass of an `Experts` class: `experts_mixin(experts_cls)` plus a `Config` with the
    adapter fields and an `__init__` that creates each expert's adapters (a new `Config`: see
    `lora_linear_class`)."""
    base = experts_mixin(experts_cls)
    parent_config = experts_cls.Config

    class LoRAExperts(base):  # type: ignore[valid-type, misc]
        @dataclass(kw_only=True, slots=True)
        class Config(parent_config):  # type: ignore[valid-type, misc]
            rank: int
            scale: float
            dropout: float = 0.0
            adapter_dtype: str = "float32"

        def __init__(self, config: Config) -> None:
            super().__init__(config)
            dtype = getattr(torch, config.adapter_dtype)
            experts, dim, hidden = config.num_experts, config.dim, config.hidden_dim
            for proj, (out_features, in_features) in zip(EXPERT_ADAPTERS, ((2 * hidden, dim), (dim, hidden))):
                self.register_parameter(f"lora_A_{proj}", nn.Parameter(
                    torch.empty(experts, config.rank, in_features, dtype=dtype)))
                self.register_parameter(f"lora_B_{proj}", nn.Parameter(
                    torch.empty(experts, out_features, config.rank, dtype=dtype)))
            self.scale = config.scale
            self.lora_dropout_p = config.dropout

    LoRAExperts.__name__ = LoRAExperts.__qualname__ = f"LoRA{experts_cls.__name__}"
    return LoRAExperts


def experts_names(model_config: Module.Config) -> list[str]:
    """The qualified names of the routed experts a config tree builds, in build order."""
    return [fqn for fqn, *_ in model_config.traverse(Experts.Config, recurse=False)]


@dataclass
class ExpertsLoRAConverter:
    """Rewrites every routed-experts config of a tree into LoRA experts of `rank` and `scale`; adapters seeded
    (seed, `first_index` + i) for the i-th experts module in build order, after the LoRA linears' indices."""

    experts_mixin: Callable[[type], type]
    rank: int
    scale: float
    dropout: float = 0.0
    dtype: str = "float32"
    seed: int = 0
    first_index: int = 0
    targets: list[str] = dataclasses.field(default_factory=list)

    def __call__(self, model_config: Module.Config) -> Module.Config:
        self.targets = []
        found = list(model_config.traverse(Experts.Config, recurse=False))
        if not found:
            raise ValueError("[lora] target_modules names `experts`, but this model has no routed experts (a "
                             "dense family): remove it, or choose an MoE family such as qwen3_moe")
        for index, (fqn, cfg, parent, attr) in enumerate(found):
            new = lora_experts_class(cfg._owner, self.experts_mixin).Config(
                **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init},
                rank=self.rank, scale=self.scale, dropout=self.dropout, adapter_dtype=self.dtype)
            seed = self.seed * 1_000_003 + self.first_index + index
            new.param_init = {**cfg.param_init, **{
                f"lora_{ab}_{proj}": init_expert_lora_A(seed * 2 + i) if ab == "A" else init_zeros
                for i, proj in enumerate(EXPERT_ADAPTERS) for ab in "AB"}}
            if isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
            self.targets.append(fqn)
        return model_config
