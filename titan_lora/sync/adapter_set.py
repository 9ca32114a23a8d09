"""Several adapters of one model as rank 0 publishes them: all gathered in one collective, each in PEFT naming
with its own config, and all together for an emitter that sends them in one stream."""

from __future__ import annotations

import types
from pathlib import Path

import torch.nn as nn

from titan_lora.clients.base import AdapterPayload, AdapterSet
from titan_lora.config import LoRA
from titan_lora.export.peft import PeftLayout, peft_config, save_peft_dir
from titan_lora.lora.layer import adapter_params
from titan_lora.lora.multi import adapter_of, one_adapter_name
from titan_lora.lora.targets import hf_leaf_names, leaf_names_of
from titan_lora.sync.adapter_source import peft_names_and_layouts
from titan_lora.sync.gather import Lend, ShardGatherer
from titan_lora.sync.versions import versioned_name
from titan_lora.transfer.protocol import adapter_set_name
from titan_lora.transfer.transport import offset_in, plain_buffer


class AdapterSetSource:
    """Collective snapshots of every adapter of a model with several (`lora.multi`); rank 0 receives them."""

    def __init__(self, model: nn.Module, layout: PeftLayout, adapters: list[tuple[str, LoRA]],
                 base_model_path: str = "", lend: Lend = plain_buffer) -> None:
        """`adapters`: (name, its LoRA keys) in the model's adapter order; a name is the family its versions
        are published under (`<name>-v<step>`). `lend`: rank 0's gather buffer, from the emitter."""
        by_adapter: list[list[tuple[str, nn.Parameter]]] = [[] for _ in adapters]
        for name, p in adapter_params(model):
            by_adapter[adapter_of(name)].append((name, p))
        params = [param for part in by_adapter for param in part]  # adapter by adapter: each one run of bytes
        peft_names, layouts, _ = peft_names_and_layouts([one_adapter_name(name) for name, _ in params], layout)
        self.gatherer = ShardGatherer(params, layouts=layouts, lend=lend)
        self.names = [name for name, _ in adapters]
        self.configs = []
        for (name, lora), part in zip(adapters, by_adapter):
            modules = list(dict.fromkeys(one_adapter_name(param_name).rsplit(".", 1)[0] for param_name, _ in part))
            self.configs.append(peft_config(lora, hf_leaf_names(modules, leaf_names_of(layout.hf_modules)),
                                            base_model_path))
        self.ranks = [lora.rank for _, lora in adapters]
        self.rank = max(self.ranks)
        self.adapts_experts = False  # several adapters do not target routed experts (lora/converter.py)
        self.target_modules = sorted({t for config in self.configs for t in config["target_modules"]})
        views = self.gatherer.views
        counts = [len(part) for part in by_adapter]
        starts = [sum(counts[:k]) for k in range(len(counts))]
        # Read-only mappings of the same views every sync: each emitter recognises them and reuses its plan.
        self._parts = [types.MappingProxyType(dict(zip(peft_names[s:s + n], list(views.values())[s:s + n])))
                       for s, n in zip(starts, counts)] if views else None
        self._together = types.MappingProxyType(
            {adapter_set_name(k, peft): view for k, part in enumerate(self._parts or [])
             for peft, view in part.items()}) if views else None
        home = self.gatherer.home
        self._home_offset = offset_in(home, next(iter(views.values()))) if home is not None else None
        self._part_bytes = ([sum(t.numel() * t.element_size() for t in part.values()) for part in self._parts]
                            if views else [])

    def set_scale(self, adapter: int, scale: float) -> None:
        """The engine scales `adapter` by `scale` from its next snapshot on (its config keeps the built rank:
        a smaller rank held in it as zero rows scales as its own, alpha = scale x the built rank)."""
        self.configs[adapter]["lora_alpha"] = scale * self.configs[adapter]["r"]

    def snapshot(self, version: int) -> AdapterSet | None:
        """Collective. Rank 0 gets version `version` of every adapter (views reused by the next call)."""
        gathered = self.gatherer.gather()
        if gathered is None:
            return None
        finite, checksum = self.gatherer.finite_and_checksum()
        home = self.gatherer.home
        parts = tuple(
            AdapterPayload(versioned_name(name, version), version, tensors, config, home, finite, nbytes)
            for name, tensors, config, nbytes in zip(self.names, self._parts, self.configs, self._part_bytes))
        together = AdapterPayload(
            name="+".join(p.name for p in parts), version=version, tensors=self._together, peft_config={},
            home=home, finite=finite, known_nbytes=self.gatherer.nbytes,
            home_checksum=None if home is None else (self._home_offset, self.gatherer.region_bytes, checksum))
        return AdapterSet(parts, together)

    def export(self, path: str | Path) -> Path | None:
        """Collective. Rank 0 writes one PEFT directory per adapter, `path/<name>`; returns `path` there."""
        adapters = self.snapshot(version=0)
        if adapters is None:
            return None
        for name, part in zip(self.names, adapters.parts):
            save_peft_dir(Path(path) / name, part.tensors, part.peft_config)
        return Path(path)
