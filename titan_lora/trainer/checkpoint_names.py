"""The names adapter checkpoints store their tensors under: PEFT's, not torchtitan's module paths.

torchtitan renames modules between releases (0.3.0: `attention.wq` -> `attention.qkv_linear.wq`,
`output` -> `lm_head`); PEFT's names follow the HF checkpoint and do not move, so a checkpoint keyed by them
resumes across such a change. Values are stored as the trainer holds them (the RoPE rows of q/k lora_B in
torchtitan's interleaved order: the signature says so), so a save is a rename, never a gather.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from titan_lora.export.peft import PeftLayout, hf_module_name, peft_name_and_rope
from titan_lora.lora.multi import adapter_of, one_adapter_name

NAMES = "peft"
"""The signature's `names` for checkpoints keyed by PEFT names; a signature without `names` is keyed by
torchtitan 0.2.2's module paths (written before this module)."""
TARGETS = "hf"
"""The signature's `targets` when its `target_modules` are HF module names (`model.layers.0.self_attn.q_proj`);
a signature without `targets` lists torchtitan 0.2.2's module paths (`layers.0.attention.wq`)."""
RENAMED_AT_030 = (("attention.wq", "attention.qkv_linear.wq"), ("attention.wk", "attention.qkv_linear.wk"),
                  ("attention.wv", "attention.qkv_linear.wv"), ("output", "lm_head"))
"""The module paths torchtitan 0.3.0 renamed, as (0.2.2 path, 0.3.0 path), each matched on whole segments."""
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


def adapter_peft_names(fqns: list[str], layout: PeftLayout, adapters: list[str]) -> dict[str, str]:
    """Each parameter of a K-adapter model keyed by its adapter's name and the PEFT name a one-adapter model
    gives it (`layers.0.attention.qkv_linear.wq.lora_A_1` -> `math/base_model.model.model.layers.0.self_attn.
    q_proj.lora_A.weight` for adapters[1] == "math"): a checkpoint resumes by adapter name, never by index."""
    names = {fqn: f"{adapters[adapter_of(fqn)]}/{peft_name_and_rope(one_adapter_name(fqn), layout)[0]}"
             for fqn in fqns}
    if len(set(names.values())) != len(names):
        raise ValueError("two adapter parameters map to one stored name; the family's PeftLayout is wrong")
    return names


def adapters_change(saved: list[dict] | None, ours: list[dict]) -> str | None:
    """What differs between a checkpoint's adapters and this job's (each {"name", "lora_rank",
    "target_modules"}, in table order), in words; None when they are the same."""
    if saved == ours:
        return None
    if saved is None:
        return f"it was saved by a one-adapter job, this job has the adapters {[a['name'] for a in ours]}"
    theirs, mine = [a["name"] for a in saved], [a["name"] for a in ours]
    if set(theirs) != set(mine):
        added, removed = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
        return f"its adapters are {theirs}, this job's {mine} (added {added}, removed {removed})"
    if theirs != mine:
        return f"its adapters are in the order {theirs}, this job's tables in {mine}"
    changed = [a["name"] for a, b in zip(saved, ours) if a != b]
    return f"the adapters {changed} have another rank or other target_modules than when it was saved"


def from_torchtitan_022(path: str) -> str:
    """A torchtitan 0.2.2 module or parameter path as 0.3.0 names it (`layers.0.attention.wq.lora_A` ->
    `layers.0.attention.qkv_linear.wq.lora_A`, `output` -> `lm_head`); other paths are unchanged."""
    return _renamed(path, RENAMED_AT_030)


def to_torchtitan_022(path: str) -> str:
    """A torchtitan 0.3.0 module or parameter path as 0.2.2 named it (the inverse of `from_torchtitan_022`)."""
    return _renamed(path, tuple((new, old) for old, new in RENAMED_AT_030))


def _renamed(path: str, renames: tuple[tuple[str, str], ...]) -> str:
    for old, new in renames:  # whole dotted segments: after the start or a dot, before a dot or the end
        path = re.sub(rf"(?<![^.]){re.escape(old)}(?![^.])", new, path)
    return path


def hf_targets(modules: list[str], hf_modules: Mapping[str, str]) -> list[str]:
    """The HF module names of torchtitan modules `modules`, sorted (a name with no HF module is kept as is,
    so a comparison shows it)."""
    def hf(module: str) -> str:
        try:
            return hf_module_name(module, hf_modules)
        except KeyError:
            return module
    return sorted(hf(module) for module in modules)


def saved_hf_targets(signature: Mapping[str, Any], hf_modules: Mapping[str, str]) -> list[str]:
    """A checkpoint signature's adapted modules as HF module names, also from a signature that lists
    torchtitan 0.2.2's module paths (written before `TARGETS`)."""
    if signature.get("targets") == TARGETS:
        return sorted(signature["target_modules"])
    return hf_targets([from_torchtitan_022(m) for m in signature["target_modules"]], hf_modules)


def renamed_params(state: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """`state` keyed by parameter name, with every key renamed through `names`."""
    return {names[key]: value for key, value in state.items()}


def optimizer_state_param(key: str) -> tuple[str, str, str] | None:
    """A flattened optimizer state key split into its section, parameter name and field
    (`state.<param>.exp_avg` -> ("state.", "<param>", "exp_avg")); None for a key of no known section."""
    section = next((s for s in _OPTIMIZER_SECTIONS if key.startswith(s)), None)
    if section is None:
        return None
    param, _, field = key[len(section):].rpartition(".")
    return section, param, field


def renamed_optimizer_state(state: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """A flattened optimizer state dict (`state.<param>.<key>`, `param_groups.<param>.<key>`) with each
    parameter name renamed through `names`; a key naming no known parameter is an error."""
    out = {}
    for key, value in state.items():
        parts = optimizer_state_param(key)
        if parts is None or parts[1] not in names:
            raise KeyError(f"optimizer state key {key!r} names no adapter parameter; known: "
                           f"{sorted(names)[:3]} ...")
        section, param, field = parts
        out[f"{section}{names[param]}.{field}"] = value
    return out
