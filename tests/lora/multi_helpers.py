"""Helpers for the K-adapter layer's own tests, on linears made by `multi.add_adapters` outside torchtitan's
config tree (jobs build, initialise and group them through it: `titan/multi_lora_linear.py`, `train.py`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from titan_lora.lora.multi import MultiLoRALayer, adapter_of
from titan_lora.titan.lora_linear import init_lora_A


def params_by_adapter(model: nn.Module, num_adapters: int) -> list[list[tuple[str, nn.Parameter]]]:
    """Each adapter's (name, parameter) pairs, in the model's parameter order (the same on every rank)."""
    groups: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(num_adapters)]
    for name, param in model.named_parameters():
        k = adapter_of(name)
        if k is not None:
            groups[k].append((name, param))
    empty = [k for k, group in enumerate(groups) if not group]
    if empty:
        raise ValueError(f"adapters {empty} target no linear of the model: give each adapter at least one "
                         "target")
    return groups


def init_adapters(model: nn.Module, seeds: Sequence[int]) -> None:
    """Each adapter initialised as the single-adapter path does with its own seed: A kaiming-uniform from a
    generator seeded by (seed_k, index of the linear among those k targets, in module order), B zero."""
    index = [0] * len(seeds)
    for module in model.modules():
        if not isinstance(module, MultiLoRALayer):
            continue
        for k in module.adapter_scales:
            init_lora_A(seeds[k] * 1_000_003 + index[k])(getattr(module, f"lora_A_{k}"))
            with torch.no_grad():
                getattr(module, f"lora_B_{k}").zero_()
            index[k] += 1


def adapter_param_groups(params: Sequence[Sequence[tuple[str, nn.Parameter]]],
                         lrs: Sequence[float]) -> list[dict]:
    """One optimizer param group per adapter (`multi.params_by_adapter`'s lists), with that adapter's lr."""
    if len(params) != len(lrs):
        raise ValueError(f"{len(lrs)} learning rates for {len(params)} adapters: give one lr per adapter")
    return [{"params": [p for _, p in group], "param_names": [n for n, _ in group], "lr": lr, "adapter": k}
            for k, (group, lr) in enumerate(zip(params, lrs))]
