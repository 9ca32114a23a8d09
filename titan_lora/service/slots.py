"""Adapter slots: the model is built with `[service] max_adapters` K-adapter slots at `max_rank`; each Tinker
training client takes one, with its own rank, seed, parts and AdamW.

A client of rank r < max_rank is exact in a slot of max_rank: rows r.. of A and columns r.. of B start at zero,
so their gradients are zero (dB[:, j] = g^T (x A[j]) and dA[j] = B[:, j]^T g), Adam moves nothing with a zero
gradient, and they stay zero. A part the client does not train (train_attn/train_mlp/train_unembed false) gets
scale 0 and zero A: its delta and gradients are zero. The scale of a trained linear is lora_alpha / r.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_lora.lora.multi import MultiLoRALayer, one_adapter_name, param_pattern
from titan_lora.titan.lora_linear import fill_param, init_lora_A
from titan_lora.titan.optim import clip_grad_norm_


@dataclass(frozen=True)
class SlotSpec:
    """What a client asked for at `create_lora_training_client`."""

    rank: int
    seed: int = 0
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True


@dataclass(frozen=True)
class AdamStep:
    """One `optim_step`'s AdamW settings (Tinker's AdamParams; grad_clip_norm 0: no clipping)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


def part_of(linear: str) -> str:
    """Which Tinker part a linear belongs to: "attn", "mlp" or "unembed"."""
    if linear.rsplit(".", 1)[-1] in ("lm_head", "output"):
        return "unembed"
    return "attn" if ".attention." in f".{linear}." else "mlp"


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone().cpu()


def _like(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """`full` placed as `param` is: this rank's shard of it for a DTensor."""
    full = full.to(param.device, param.dtype)
    if isinstance(param, DTensor):
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    return full.clone()


class AdapterSlots:
    """The slots of one K-adapter model: claim one for a client, step its optimizer, save and load its state."""

    def __init__(self, model: nn.Module, alpha: float) -> None:
        self.model = model
        self.alpha = alpha
        self.layers = [(name, m) for name, m in model.named_modules() if isinstance(m, MultiLoRALayer)]
        if not self.layers:
            raise ValueError("the service's model has no multi-adapter LoRA linear: build it with "
                             "[service] max_adapters >= 2 adapter slots")
        self.count = self.layers[0][1].num_adapters
        self.max_rank = max(getattr(m, f"lora_A_{k}").shape[0] for _, m in self.layers for k in m.adapter_scales)
        self.parts = sorted({part_of(name) for name, _ in self.layers})
        named = list(model.named_parameters())
        self.params = {k: [(one_adapter_name(n), p) for n, p in named if re.search(param_pattern(k), n)]
                       for k in range(self.count)}
        self.specs: dict[int, SlotSpec] = {}
        self.optimizers: dict[int, torch.optim.AdamW] = {}

    def claim(self, slot: int, spec: SlotSpec) -> None:
        """Collective under FSDP: give `slot` a fresh adapter of `spec` (kaiming A from `spec.seed`, zero B) and
        a fresh AdamW. The same seed gives the same adapter in any slot."""
        wanted = {"attn": spec.train_attn, "mlp": spec.train_mlp, "unembed": spec.train_unembed}
        for index, (name, layer) in enumerate(self.layers):
            a, b = getattr(layer, f"lora_A_{slot}"), getattr(layer, f"lora_B_{slot}")
            full = torch.empty(a.shape, dtype=torch.float32)
            init_lora_A(spec.seed * 1_000_003 + index)(full)
            trained = wanted[part_of(name)]
            full[spec.rank:] = 0.0
            if not trained:
                full.zero_()
            fill_param(a, full.to(a.dtype))
            fill_param(b, torch.zeros(b.shape, dtype=b.dtype))
            layer.adapter_scales[slot] = self.alpha / spec.rank if trained else 0.0
        for _, param in self.params[slot]:
            param.grad = None
        self.specs[slot] = spec
        self.optimizers[slot] = torch.optim.AdamW([p for _, p in self.params[slot]], lr=AdamStep.learning_rate)

    def release(self, slot: int) -> None:
        """Forget `slot`'s client: its optimizer and gradients (the next claim re-initialises its weights)."""
        self.specs.pop(slot, None)
        self.optimizers.pop(slot, None)
        for _, param in self.params[slot]:
            param.grad = None

    def step(self, slot: int, adam: AdamStep) -> dict[str, float]:
        """Collective: one AdamW step of `slot` over the gradients its forward_backward calls accumulated,
        clipped to `adam.grad_clip_norm` if set; the gradients are then cleared. Other slots are untouched."""
        params = [p for _, p in self.params[slot]]
        norm = clip_grad_norm_([p for p in params if p.grad is not None],
                               adam.grad_clip_norm if adam.grad_clip_norm > 0 else float("inf"), foreach=True)
        optimizer = self.optimizers[slot]
        for group in optimizer.param_groups:
            group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                         weight_decay=adam.weight_decay)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float(norm)}

    def state(self, slot: int, with_optimizer: bool = True) -> dict:
        """Collective: `slot`'s whole state on every rank (the adapter in one-adapter names, its spec and,
        with `with_optimizer`, AdamW's moments and step), loadable into any slot."""
        state: dict = {"spec": asdict(self.specs[slot]), "params": {n: _full(p) for n, p in self.params[slot]}}
        if with_optimizer:
            moments = self.optimizers[slot].state
            state["optimizer"] = {n: {key: _full(value) for key, value in moments[p].items()}
                                  for n, p in self.params[slot] if p in moments}
        return state

    def load(self, slot: int, state: dict, with_optimizer: bool) -> None:
        """Collective: put a `state` into `slot` (its spec, adapter and, with `with_optimizer`, AdamW state)."""
        self.claim(slot, SlotSpec(**state["spec"]))
        for name, param in self.params[slot]:
            fill_param(param, state["params"][name].to(param.dtype))
        if with_optimizer:
            optimizer = self.optimizers[slot]
            for name, param in self.params[slot]:
                saved = state["optimizer"].get(name)
                if saved:
                    optimizer.state[param] = {key: value if key == "step" else _like(param, value)
                                              for key, value in saved.items()}
