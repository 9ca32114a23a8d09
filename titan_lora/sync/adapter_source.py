"""The adapter as rank 0 publishes it: gathered in one collective, in PEFT naming, with its config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.nn as nn
from torchtitan.models.llama3.model.state_dict_adapter import Llama3StateDictAdapter

from titan_lora.config import LoRA
from titan_lora.emitters.base import AdapterPayload
from titan_lora.export.peft import peft_config, save_peft_dir, to_peft_names
from titan_lora.lora.layer import adapter_params, lora_modules
from titan_lora.lora.targets import hf_leaf_names
from titan_lora.sync.gather import ShardGatherer
from titan_lora.sync.versions import versioned_name


class AdapterSource:
    """Collective snapshots of a model's adapter; rank 0 receives them ready to emit or save."""

    def __init__(
        self, model: nn.Module, sd_adapter: Llama3StateDictAdapter, lora: LoRA, lora_name: str = "policy",
        base_model_path: str = "",
    ) -> None:
        self.gatherer = ShardGatherer(adapter_params(model))
        self.lora_name = lora_name
        self.sd_adapter = sd_adapter
        self.target_modules = hf_leaf_names([n for n, _ in lora_modules(model)])
        self.config: dict[str, Any] = peft_config(lora, self.target_modules, base_model_path)
        self.rank = lora.rank

    def snapshot(self, version: int) -> AdapterPayload | None:
        """Collective. Rank 0 gets the adapter as of now (views reused by the next call); others None."""
        gathered = self.gatherer.gather()
        if gathered is None:
            return None
        return AdapterPayload(
            name=versioned_name(self.lora_name, version),
            version=version,
            tensors=to_peft_names(gathered, self.sd_adapter),
            peft_config=self.config,
        )

    def snapshot_is_finite(self) -> bool:
        """Rank 0: True when the last snapshot holds no NaN or Inf (one kernel, one host sync)."""
        return self.gatherer.all_finite()

    def export(self, path: str | Path) -> Path | None:
        """Collective. Rank 0 writes a PEFT directory (adapter_config.json + safetensors) to `path`."""
        payload = self.snapshot(version=0)
        return None if payload is None else save_peft_dir(path, payload.tensors, payload.peft_config)

