"""torchtitan 0.3.0's mixture-of-experts layer (Qwen3-MoE) as config trees built from a neutral `MoEShape`.

Part of the seam (`titan_lora.titan`). The router, dispatcher and experts are 0.3.0's (`make_moe_config`,
softmax top-k routing with `route_norm` = HF's `norm_topk_prob`), with two choices of titan_lora's:
- `load_balance_coeff` None: no `expert_bias_E` (0.3.0 updates it from an optimizer hook that a LoRA job on a
  frozen base never runs), so the routing is HF's exactly;
- `Experts`: 0.3.0's `GroupedExperts` computing in its weights' dtype. 0.3.0 casts every expert matmul to
  bfloat16 (models/common/moe.py:94-108, for CUDA's grouped GEMM), which leaves float32 logits ~1e-2 from HF's;
  with bfloat16 weights (the GPU configs) nothing changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.models.common.config_utils import make_moe_config, make_router_config, make_routed_experts_config
from torchtitan.models.common.moe import GroupedExperts, MoE

from titan_lora.model_shape import MoEShape

__all__ = ["EXPERT_WEIGHTS", "Experts", "expert_offsets", "grouped_mm", "moe_config", "moe_shape_of"]

EXPERT_WEIGHTS = ("w1_EFD", "w2_EDF", "w3_EFD")
"""0.3.0's stacked expert weights: w1 (gate) and w3 (up) are (experts, hidden, dim), w2 (down) (experts, dim,
hidden), each expert's slice an HF `nn.Linear.weight`."""


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of `x` grouped by expert (group e ends at `offsets[e]`) times each expert's `weight[e]`^T."""
    if all(n * x.element_size() % 16 == 0 for n in (x.shape[-1], weight.shape[-1], weight.shape[-2])):
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    # torch's grouped GEMM wants 16-byte strides (a rank-2 adapter in float32 has 8): one matmul per expert.
    ends = offsets.tolist()
    parts = [x[start:end] @ w.transpose(0, 1) for start, end, w in zip([0, *ends[:-1]], ends, weight)]
    return torch.cat(parts) if parts else x.new_zeros(0, weight.shape[-2])


def expert_offsets(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """The end of each expert's rows in a grouped batch (int32, as `torch._grouped_mm` takes them)."""
    return torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)


def local_weight(weight: torch.Tensor) -> torch.Tensor:
    """This rank's expert weight (0.3.0 runs its experts on local tensors, models/common/moe.py:71-81)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


class Experts(GroupedExperts):
    """0.3.0's `GroupedExperts`, its matmuls in the weights' dtype (float32 parity with HF on CPU)."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """SwiGLU per expert over its rows: w2 (silu(w1 x) * w3 x)."""
        offsets = expert_offsets(num_tokens_per_expert)
        rows = x.to(self.w1_EFD.dtype)
        gate, up = self.gate_up(rows, offsets)
        return self.down(F.silu(gate) * up, offsets).type_as(x)

    def gate_up(self, x: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each expert's gate (w1) and up (w3) projections of its rows (a LoRA subclass adds its updates)."""
        return (grouped_mm(x, local_weight(self.w1_EFD), offsets),
                grouped_mm(x, local_weight(self.w3_EFD), offsets))

    def down(self, hidden: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Each expert's down projection (w2) of its rows."""
        return grouped_mm(hidden, local_weight(self.w2_EDF), offsets)


def moe_config(dim: int, moe: MoEShape, linear_init: dict[str, Any], experts_init: dict[str, Any]) -> MoE.Config:
    """One MoE layer's 0.3.0 config tree (unbuilt): `Experts`, softmax top-k routing, no load balancing."""
    routed = make_routed_experts_config(dim=dim, hidden_dim=moe.hidden_dim, num_experts=moe.num_experts,
                                        top_k=moe.top_k, param_init={}, comm_backend="standard")
    routed.inner_experts = Experts.Config(dim=dim, hidden_dim=moe.hidden_dim, num_experts=moe.num_experts,
                                          param_init={name: experts_init["weight"] for name in EXPERT_WEIGHTS})
    return make_moe_config(
        num_experts=moe.num_experts, load_balance_coeff=None, routed_experts=routed,
        router=make_router_config(dim=dim, num_experts=moe.num_experts, gate_param_init=linear_init,
                                  top_k=moe.top_k, score_func="softmax", route_norm=moe.norm_topk_prob))


def moe_shape_of(config: Any) -> MoEShape | None:  # a Decoder.Config
    """The experts of a 0.3.0 decoder config tree as a `MoEShape` (None: every layer dense)."""
    layers = [getattr(block, "moe", None) for block in config.layers]
    first = next((moe for moe in layers if moe is not None), None)
    if first is None:
        return None
    router, experts = first.router, first.routed_experts.inner_experts
    if router.score_func != "softmax" or router.route_scale != 1.0:
        raise ValueError(f"titan_lora builds softmax-routed experts (Qwen3-MoE); this tree routes by "
                         f"{router.score_func} scaled {router.route_scale}")
    return MoEShape(num_experts=experts.num_experts, top_k=router.top_k, hidden_dim=experts.hidden_dim,
                    norm_topk_prob=router.route_norm,
                    dense_layers=tuple(i for i, moe in enumerate(layers) if moe is None))
