"""The names adapter checkpoints store their tensors under: PEFT's, not torchtitan's module paths.

torchtitan renames modules between releases (0.3.0: `attention.wq` -> `attention.qkv_linear.wq`,
`output` -> `lm_head`); PEFT's names follow the HF checkpoint and do not move, so a checkpoint keyed by them
resumes across such a change. Values are stored as the trainer holds them (the RoPE rows of q/k lora_B in
torchtitan's interleaved order: the signature says so), so a save is a rename, never a gather.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from titan_lora.export.peft import PeftLayout, peft_name_and_rope

NAMES = "peft"
"""The signature's `names` for checkpoints keyed by PEFT names; a signature without `names` is keyed by
torchtitan 0.2.2's module paths (written before this module)."""
ROW_ORDER = "torchtitan-interleaved-rope"
"""The signature's `row_order`: the RoPE rows of q/k lora_B as the trainer holds them, not permuted."""
_OPTIMIZER_SECTIONS = ("state.", "param_groups.")


def peft_names(fqns: list[str], layout: PeftLayout) -> dict[str, str]:
    """Each adapter parameter's PEFT name: `layers.0.attention.qkv_linear.wq.lora_A` ->
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
    names = {fqn: peft_name_and_rope(fqn, layout)[0] for fqn in fqns}
    if len(set(names.values())) != len(names):
        raise ValueError("two adapter parameters map to one PEFT name; the family's PeftLayout is wrong")
    return names


def renamed_params(state: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """`state` keyed by parameter name, with every key renamed through `names`."""
    return {names[key]: value for key, value in state.items()}


def renamed_optimizer_state(state: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """A flattened optimizer state dict (`state.<param>.<key>`, `param_groups.<param>.<key>`) with each
    parameter name renamed through `names`; a key naming no known parameter is an error."""
    out = {}
    for key, value in state.items():
        section = next((s for s in _OPTIMIZER_SECTIONS if key.startswith(s)), None)
        param, _, field = key[len(section or ""):].rpartition(".")
        if section is None or param not in names:
            raise KeyError(f"optimizer state key {key!r} names no adapter parameter; known: "
                           f"{sorted(names)[:3]} ...")
        out[f"{section}{names[param]}.{field}"] = value
    return out
