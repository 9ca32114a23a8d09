"""The `lora` model converter: `[model] converters = ["lora"]` applies `[lora]` to the model."""

from __future__ import annotations

import logging
import types

import torch
import torch.nn as nn
from torchtitan.protocols.model_converter import register_model_converter

from titan_lora.config import LoRA, validate_lora
from titan_lora.lora.layer import convert_linear, freeze_base, init_adapters, lora_scale
from titan_lora.lora.targets import resolve_targets

logger = logging.getLogger(__name__)


class LoRAConverter:
    """torchtitan ModelConverter that adds LoRA adapters to the targeted linears."""

    def __init__(self, job_config, parallel_dims) -> None:  # noqa: ANN001 (torchtitan's protocol)
        self.cfg: LoRA = job_config.lora
        validate_lora(self.cfg)
        self.seed = job_config.debug.seed or 0
        self.targets: list[str] = []

    def convert(self, model: nn.Module) -> None:
        """Swap the targeted linears for LoRALinear, freeze the base, and hook adapter init."""
        self.targets = apply_lora(model, self.cfg)
        seed = self.seed
        base_init = model.init_weights  # type: ignore[attr-defined]

        # torchtitan calls init_weights after materialising the sharded model; the adapters must be
        # initialised then too, since before that they live on the meta device.
        def init_weights(self_model: nn.Module, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
            base_init(*args, **kwargs)
            init_adapters(self_model, seed)

        model.init_weights = types.MethodType(init_weights, model)  # type: ignore[method-assign]
        logger.info(
            "LoRA rank %d alpha %g on %d linears (%s)",
            self.cfg.rank, self.cfg.alpha, len(self.targets), self.cfg.target_modules,
        )

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        """Nothing to do after the optimizer step (weight sync has its own hook)."""


def apply_lora(model: nn.Module, cfg: LoRA) -> list[str]:
    """Convert the targeted linears of `model` in place; returns their qualified names."""
    targets = resolve_targets(model, cfg.target_modules)
    scale = lora_scale(cfg.rank, cfg.alpha, cfg.use_rslora)
    dtype = getattr(torch, cfg.dtype)
    for name in targets:
        convert_linear(model.get_submodule(name), cfg.rank, scale, cfg.dropout, dtype)
    freeze_base(model)
    return targets


register_model_converter(LoRAConverter, "lora")
