"""A Qwen3-MoE adapter's routed-expert tensors in PEFT's fused layout rewritten per expert, the layout vLLM 0.32
loads by default (the export's rewrite and the engine's, on a sync, both use it).

PEFT 0.21 adapts HF's fused expert parameters: `mlp.experts.base_layer.lora_A.weight` (experts * r, dim) and
`lora_B` (2 hidden, r * experts) for gate_up_proj, `mlp.experts.lora_A/B` for down_proj. vLLM 0.32's Qwen3-MoE
takes per-expert keys, `mlp.experts.<e>.gate_proj.lora_A.weight` (r, dim) ... (it reads the fused layout only
with `enable_mixed_moe_lora_format` and a request flag). The rewrite is exact: gate and up share expert e's
A, their B's are the halves of its gate_up B.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

_FUSED = re.compile(r"(.*\.mlp\.experts)\.(base_layer\.)?lora_([AB])\.weight")
PER_EXPERT_TARGETS = ["gate_proj", "up_proj", "down_proj"]


def per_expert(tensors: Mapping[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """PEFT-layout adapter tensors with the fused expert adapters split per expert (others unchanged)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        match = _FUSED.fullmatch(name)
        if match is None:
            out[name] = tensor
            continue
        experts_module, gate_up, ab = match.group(1), match.group(2) is not None, match.group(3)
        if ab == "A":
            experts = tensor.shape[0] // rank
            parts = tensor.reshape(experts, rank, tensor.shape[1]).unbind(0)
        else:
            experts = tensor.shape[1] // rank
            parts = tensor.reshape(tensor.shape[0], rank, experts).permute(2, 0, 1).unbind(0)
        for e, part in enumerate(parts):
            prefix = f"{experts_module}.{e}"
            if not gate_up:
                out[f"{prefix}.down_proj.lora_{ab}.weight"] = part.contiguous()
            elif ab == "A":  # one A for gate and up
                out[f"{prefix}.gate_proj.lora_A.weight"] = part.contiguous()
                out[f"{prefix}.up_proj.lora_A.weight"] = part.clone()
            else:  # gate's rows first (HF's gate_up_proj)
                gate, up = part.chunk(2, dim=0)
                out[f"{prefix}.gate_proj.lora_B.weight"] = gate.contiguous()
                out[f"{prefix}.up_proj.lora_B.weight"] = up.contiguous()
    return out


def per_expert_adapter(tensors: Mapping[str, torch.Tensor], peft_config: Mapping[str, Any]
                       ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An adapter (its PEFT tensors and `adapter_config.json`) with its routed-expert adapters, if any
    (`target_parameters`), rewritten per expert, and its config naming the per-expert modules instead."""
    if not peft_config.get("target_parameters"):
        return dict(tensors), dict(peft_config)
    config = {**peft_config, "target_parameters": None,
              "target_modules": sorted(set(peft_config["target_modules"]) | set(PER_EXPERT_TARGETS))}
    return per_expert(tensors, peft_config["r"]), config
