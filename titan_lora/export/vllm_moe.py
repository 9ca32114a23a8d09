"""A Qwen3-MoE adapter in PEFT's layout rewritten per expert, the layout vLLM 0.32 loads by default.

PEFT 0.21 adapts HF's fused expert parameters: `mlp.experts.base_layer.lora_A.weight` (experts * r, dim) and
`lora_B` (2 hidden, r * experts) for gate_up_proj, `mlp.experts.lora_A/B` for down_proj (titan_lora's export,
`export.peft.ExpertLayout`). vLLM 0.32's Qwen3-MoE takes per-expert keys, `mlp.experts.<e>.gate_proj.lora_A.weight`
(r, dim) ... (it reads the fused layout only with `enable_mixed_moe_lora_format` and a request flag). The rewrite
is exact: gate and up share expert e's A, their B's are the halves of its gate_up B.

Run: `python -m titan_lora.export.vllm_moe PEFT_DIR OUT_DIR`.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file

from titan_lora.export.peft import save_peft_dir

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


def to_vllm_moe(peft_dir: str | Path, out: str | Path) -> Path:
    """Write the adapter in `peft_dir` (titan_lora's or PEFT's export) per expert to `out`."""
    peft_dir = Path(peft_dir)
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    if not config.get("target_parameters"):
        raise ValueError(f"{peft_dir} adapts no routed experts (no target_parameters): vLLM loads it as it is")
    tensors = per_expert(load_file(str(peft_dir / "adapter_model.safetensors")), config["r"])
    config = {**config, "target_parameters": None,
              "target_modules": sorted(set(config["target_modules"]) | set(PER_EXPERT_TARGETS))}
    return save_peft_dir(out, tensors, config)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m titan_lora.export.vllm_moe PEFT_DIR OUT_DIR")
    print(to_vllm_moe(sys.argv[1], sys.argv[2]))
