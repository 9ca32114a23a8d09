"""Resolve `[lora] target_modules` against a model's own linear layers."""

from __future__ import annotations

import torch.nn as nn

# torchtitan Llama leaf name <-> HF/PEFT leaf name. Users may write either.
TITAN_TO_HF = {
    "wq": "q_proj",
    "wk": "k_proj",
    "wv": "v_proj",
    "wo": "o_proj",
    "w1": "gate_proj",
    "w2": "down_proj",
    "w3": "up_proj",
    "output": "lm_head",
}
HF_TO_TITAN = {hf: titan for titan, hf in TITAN_TO_HF.items()}
# Excluded from "all-linear" unless named: PEFT does the same for the output head.
HEAD_NAMES = frozenset({"output", "lm_head", "tok_embeddings", "embed_tokens"})


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def resolve_targets(model: nn.Module, target_modules: list[str] | str) -> list[str]:
    """Qualified names of the linears to adapt; raises if a named target matches nothing."""
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if target_modules == "all-linear":
        return [n for n in linears if _leaf(n) not in HEAD_NAMES]
    wanted = {HF_TO_TITAN.get(t, t) for t in target_modules}
    present = {_leaf(n) for n in linears}
    missing = sorted(t for t in target_modules if HF_TO_TITAN.get(t, t) not in present)
    if missing:
        choices = ", ".join(sorted(present))
        raise ValueError(
            f"[lora] target_modules {missing} match no linear layer of this model; "
            f"its linears are: {choices} (HF names such as q_proj also work), or use \"all-linear\""
        )
    return [n for n in linears if _leaf(n) in wanted]


def hf_leaf_names(qualified: list[str]) -> list[str]:
    """The PEFT `target_modules` (HF leaf names) for the adapted linears, sorted."""
    return sorted({TITAN_TO_HF.get(_leaf(n), _leaf(n)) for n in qualified})
