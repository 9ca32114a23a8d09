"""The adapter as rank 0 publishes it: gathered in one collective, in PEFT naming, with its config."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import torch.nn as nn

from titan_lora.clients.base import AdapterPayload
from titan_lora.config import LoRA
from titan_lora.export.peft import (
    PeftLayout, expert_layout, peft_config, peft_name_and_rope, save_peft_dir, TitanRopeOrder,
)
from titan_lora.lora.layer import LoRAExperts, adapter_params, lora_modules
from titan_lora.lora.targets import hf_leaf_names, leaf_names_of
from titan_lora.sync.gather import Layout, Lend, ShardGatherer
from titan_lora.sync.versions import versioned_name
from titan_lora.transfer.transport import offset_in, plain_buffer


def peft_names_and_layouts(names: list[str], layout: PeftLayout, shapes: list[tuple[int, ...]] | None = None,
                           ) -> tuple[list[str], list[Layout | None], list[tuple[int, ...] | None]]:
    """The PEFT name of each adapter param (torchtitan names of a one-adapter model of param `shapes`), the
    order the gather writes it in and its shape there (None: the param's): the scatter puts RoPE lora_B rows
    straight into HF (rotate-half) order and stacked expert adapters into PEFT's layout, so no per-step
    permute."""
    named = [peft_name_and_rope(name, layout) for name in names]
    experts = [expert_layout(name, shape) for name, shape in zip(names, shapes or [()] * len(names))]
    layouts = [expert.to_trainer if expert is not None else None if rope is None else TitanRopeOrder(rope)
               for (_, rope), expert in zip(named, experts)]
    return [peft for peft, _ in named], layouts, [None if e is None else e.peft_shape for e in experts]


class AdapterSource:
    """Collective snapshots of a model's adapter; rank 0 receives them ready to emit or save."""

    def __init__(
        self, model: nn.Module, layout: PeftLayout, lora: LoRA, lora_name: str = "policy",
        base_model_path: str = "", lend: Lend = plain_buffer,
    ) -> None:
        """`lend`: rank 0's gather buffer, from the emitter that will send it (`Emitter.lend_buffer`). A model
        with several adapters is published by `AdapterSetSource`."""
        params = adapter_params(model)
        self.peft_names, layouts, shapes = peft_names_and_layouts(
            [name for name, _ in params], layout, [tuple(p.shape) for _, p in params])
        self.gatherer = ShardGatherer(params, layouts=layouts, lend=lend, out_shapes=shapes)
        # The gatherer hands out the same views every time: one read-only mapping of them in PEFT naming
        # serves every snapshot, so the emitter recognises it and reuses its bucket plan.
        views = self.gatherer.views
        self._tensors = types.MappingProxyType(dict(zip(self.peft_names, views.values()))) if views else None
        home = self.gatherer.home
        self._home_offset = offset_in(home, next(iter(views.values()))) if home is not None else None
        self.lora_name = lora_name
        modules = list(lora_modules(model))
        adapted = [n for n, m in modules if not isinstance(m, LoRAExperts)]
        self.target_modules = hf_leaf_names(adapted, leaf_names_of(layout.hf_modules))
        experts = len(adapted) < len(modules)
        self.adapts_experts = experts
        """Whether the adapter is on routed experts too (the engine must serve expert LoRA)."""
        self.config: dict[str, Any] = peft_config(lora, self.target_modules, base_model_path, experts=experts)
        self.rank = lora.rank

    def snapshot(self, version: int) -> AdapterPayload | None:
        """Collective. Rank 0 gets the adapter as of now (views reused by the next call); others None."""
        gathered = self.gatherer.gather()
        if gathered is None:
            return None
        finite, checksum = self.gatherer.finite_and_checksum()  # one host read for both
        home = self.gatherer.home
        return AdapterPayload(
            name=versioned_name(self.lora_name, version),
            version=version,
            tensors=self._tensors,
            peft_config=self.config,
            home=home,
            finite=finite,
            known_nbytes=self.gatherer.nbytes,
            home_checksum=None if home is None else (self._home_offset, self.gatherer.region_bytes, checksum),
        )

    def export(self, path: str | Path) -> Path | None:
        """Collective. Rank 0 writes a PEFT directory (adapter_config.json + safetensors) to `path`."""
        payload = self.snapshot(version=0)
        return None if payload is None else save_peft_dir(path, payload.tensors, payload.peft_config)

