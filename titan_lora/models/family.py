"""Model families: what titan_lora needs to build, adapt and export one kind of model; a lazy registry.

`[model] name` selects a `ModelFamily`. It carries the torchtitan architecture it builds on (through the seam),
its flavors and its reading of config.json as `DecoderShape`s, the torchtitan <-> HF module names (the leaf names
that `[lora] target_modules` accepts and the PEFT export writes), which lora_B rows need the RoPE
permutation, and where its default HF assets come from. Callers ask the family, never a model's
constants. Built-in families load lazily (`titan_lora.registry`); a plug-in is registered with
`register_model_family` or named in the config as `package.module:FAMILY`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch.nn as nn

from titan_lora.config import JobConfig
from titan_lora.export.peft import PeftLayout, RopeRows
from titan_lora.lora.converter import LoRAConverter
from titan_lora.lora.parallelize import lora_parallelize
from titan_lora.lora.targets import leaf_names_of
from titan_lora.model_shape import DecoderShape
from titan_lora.registry import Registry
from titan_lora.titan.converters import register_converter
from titan_lora.titan.models import Architecture
from titan_lora.titan.parallel import ParallelDims


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One `[model] name`: how to build its model, name its adapters and find its HF assets."""

    name: str
    architecture: Architecture
    """The torchtitan decoder it builds (model, state-dict adapter, TP plan), from the seam."""
    flavors: Mapping[str, DecoderShape]
    """`[model] flavor` -> the shape of a random-init model."""
    hf_modules: Mapping[str, str]
    """torchtitan module -> HF module, `{}` for the layer:
    `layers.{}.attention.qkv_linear.wq` -> `model.layers.{}.self_attn.q_proj`."""
    rope_rows: Callable[[DecoderShape], Mapping[str, RopeRows]]
    """For a shape: the modules whose output rows torchtitan keeps in interleaved RoPE order."""
    default_assets: Callable[[bool], Path] | None = None
    """The HF directory (config, tokenizer; weights when the bool says so); None: `[model] hf_assets_path`."""
    model_types: tuple[str, ...] = ()
    """The config.json `model_type`s of the checkpoints this family loads (`("qwen3",)`)."""
    shape_from_hf: Callable[[Mapping[str, Any]], DecoderShape] | None = None
    """config.json -> the model's shape (raising on what the model cannot express); None: flavors only."""

    @property
    def leaf_names(self) -> dict[str, str]:
        """torchtitan leaf -> HF leaf (`wq` -> `q_proj`): the names `[lora] target_modules` accepts."""
        return leaf_names_of(self.hf_modules)

    def peft_layout(self, shape: DecoderShape) -> PeftLayout:
        """The PEFT naming and RoPE rows of a model of `shape`."""
        return PeftLayout(hf_modules=self.hf_modules, rope=self.rope_rows(shape))

    def parallelize(self, model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
        """TP (the configs' shardings, adapters placed alongside), activation checkpointing, compile and FSDP,
        LoRA-aware."""
        return lora_parallelize(model, parallel_dims, job_config)

    def hf_dir(self, hf_assets_path: str, need_weights: bool) -> str:
        """The HF checkpoint directory: the family's own assets, else `[model] hf_assets_path`."""
        return str(self.default_assets(need_weights)) if self.default_assets else hf_assets_path


BUILT_IN_FAMILIES = {
    "smollm2": "titan_lora.models.smollm2:SMOLLM2",
    "llama3": "titan_lora.models.llama3:LLAMA3",
    "llama3_lora": "titan_lora.models.llama3:LLAMA3",  # the name before `llama3`, kept for old configs
    "qwen3": "titan_lora.models.qwen3:QWEN3",
    "qwen3_moe": "titan_lora.models.qwen3_moe:QWEN3_MOE",
}
_FAMILIES: Registry[ModelFamily] = Registry("[model] name", "model family", BUILT_IN_FAMILIES,
                                            accept=ModelFamily)


def register_model_family(family: ModelFamily) -> ModelFamily:
    """Register a plug-in family under `family.name`, for `[model] name = name`."""
    return _FAMILIES.register(family.name, family)


def registered_model_families() -> list[str]:
    """The names `[model] name` accepts (besides `package.module:FAMILY`)."""
    return _FAMILIES.names()


def model_family(name: str) -> ModelFamily:
    """The family `[model] name` selects: a registered name or `package.module:FAMILY`."""
    return _FAMILIES.get(name)


def families_for_model_type(model_type: str) -> list[str]:
    """The registered names whose family loads config.json's `model_type`, those without own assets first;
    an old name kept for a renamed family (`llama3_lora`) is left out."""
    named = [(name, model_family(name)) for name in registered_model_families()]
    loading = [(f.default_assets is not None, name) for name, f in named
               if model_type in f.model_types and f.name == name]
    return [name for _, name in sorted(loading)]


class FamilyLoRAConverter(LoRAConverter):
    """The "lora" converter, resolving `[lora] target_modules` in the selected family's leaf names."""

    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims) -> None:
        super().__init__(job_config, parallel_dims, model_family(job_config.model.name).leaf_names)


register_converter(FamilyLoRAConverter, "lora")
