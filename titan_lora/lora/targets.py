"""Resolve `[lora] target_modules` against a model's own linear layers, in its family's leaf names."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch.nn as nn

LeafNames = Mapping[str, str]
"""A family's linear leaf names, torchtitan -> HF/PEFT (`wq` -> `q_proj`); users may write either."""
# Excluded from "all-linear" unless named: PEFT does the same for the output head.
HEAD_NAMES = frozenset({"lm_head", "tok_embeddings", "embed_tokens"})
EXPERTS = "experts"
"""The `[lora] target_modules` entry that adapts every routed expert of a mixture-of-experts model."""
ROUTER_SEGMENT = ".router."
DENSE_MLP_SEGMENT = ".feed_forward."
"""In the qualified name of an MoE router's gate: never adapted, so LoRA keeps the base model's routing."""


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def leaf_names_of(hf_modules: Mapping[str, str]) -> dict[str, str]:
    """The leaf-name map of a module-name map (`layers.{}.attention.qkv_linear.wq` -> `...self_attn.q_proj`)."""
    return {_leaf(titan): _leaf(hf) for titan, hf in hf_modules.items()}


def resolve_targets(model: nn.Module, target_modules: list[str] | str, names: LeafNames) -> list[str]:
    """Qualified names of the linears to adapt; raises if a named target matches nothing."""
    return resolve_target_names([n for n, m in model.named_modules() if isinstance(m, nn.Linear)],
                                target_modules, names)


def resolve_target_names(linears: Sequence[str], target_modules: list[str] | str, names: LeafNames) -> list[str]:
    """Of the linears' qualified names, those to adapt (`experts` left to the experts converter; an MoE router
    never); raises if a named target matches nothing."""
    routers = {_leaf(n) for n in linears if ROUTER_SEGMENT in n}
    # In a mixture-of-experts model PEFT 0.21 reads gate_proj/up_proj/down_proj as the experts' projections
    # (peft/utils/transformers_weight_conversion.py), so an adapter on a dense layer's MLP would load wrongly.
    dense_mlp = {_leaf(n) for n in linears if routers and DENSE_MLP_SEGMENT in n}
    linears = [n for n in linears if ROUTER_SEGMENT not in n and not (routers and DENSE_MLP_SEGMENT in n)]
    if target_modules == "all-linear":
        return [n for n in linears if _leaf(n) not in HEAD_NAMES]
    to_titan = {hf: titan for titan, hf in names.items()}
    target_modules = [t for t in target_modules if t != EXPERTS]
    wanted = {to_titan.get(t, t) for t in target_modules}
    present = {_leaf(n) for n in linears}
    router = sorted(t for t in target_modules if to_titan.get(t, t) in routers - present)
    if router:
        raise ValueError(f"[lora] target_modules {router} name the MoE router, which titan_lora does not adapt "
                         "(LoRA keeps the base model's routing, and vLLM serves no adapter on it); remove it")
    dense = sorted(t for t in target_modules if to_titan.get(t, t) in dense_mlp - present)
    if dense:
        raise ValueError(f"[lora] target_modules {dense} name the MLP of this mixture-of-experts model's dense "
                         "layers, which titan_lora does not adapt: PEFT reads those names as the experts' "
                         "projections, so the export would load wrongly; adapt `experts` instead")
    missing = sorted(t for t in target_modules if to_titan.get(t, t) not in present)
    if missing:
        hf = sorted(names[p] for p in present if p in names)
        by_hf = f" (or by HF name: {', '.join(hf)})" if hf else ""
        renamed = ("; torchtitan 0.3.0 names the output head lm_head (0.2.2 named it output): write lm_head"
                   if "output" in missing and "lm_head" in present else "")
        raise ValueError(
            f"[lora] target_modules {missing} match no linear layer of this model; "
            f"its linears are: {', '.join(sorted(present))}{by_hf}, or use \"all-linear\"{renamed}"
        )
    return [n for n in linears if _leaf(n) in wanted]


def hf_leaf_names(qualified: list[str], names: LeafNames) -> list[str]:
    """The PEFT `target_modules` (HF leaf names) for the adapted linears, sorted."""
    return sorted({names.get(_leaf(n), _leaf(n)) for n in qualified})
