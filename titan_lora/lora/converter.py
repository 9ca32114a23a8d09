"""The LoRA model converter: `[model] converters = ["lora"]` applies `[lora]` to the model.

torchtitan builds converters from the job config alone; `titan_lora.models.family` registers the
"lora" name with the leaf names of the family that `[model] name` selects.
"""

from __future__ import annotations

import logging
import types

import torch
import torch.nn as nn

from titan_lora.config import LoRA, validate_lora
from titan_lora.lora.layer import convert_linear, freeze_base, init_adapters, lora_scale
from titan_lora.lora.targets import LeafNames, resolve_targets

logger = logging.getLogger(__name__)


class LoRAConverter:
    """torchtitan ModelConverter that adds LoRA adapters to the targeted linears."""

    def __init__(self, job_config, parallel_dims, names: LeafNames) -> None:  # noqa: ANN001 (torchtitan's)
        self.cfg: LoRA = job_config.lora
        self.names = names
        validate_lora(self.cfg)
        self.seed = job_config.debug.seed or 0
        self.targets: list[str] = []

    def convert(self, model: nn.Module) -> None:
        """Swap the targeted linears for LoRALinear, freeze the base, and hook adapter init."""
        self.targets = apply_lora(model, self.cfg, self.names)
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


def apply_lora(model: nn.Module, cfg: LoRA, names: LeafNames) -> list[str]:
    """Convert the targeted linears of `model` in place; returns their qualified names."""
    targets = resolve_targets(model, cfg.target_modules, names)
    scale = lora_scale(cfg.rank, cfg.alpha, cfg.use_rslora)
    dtype = getattr(torch, cfg.dtype)
    for name in targets:
        convert_linear(model.get_submodule(name), cfg.rank, scale, cfg.dropout, dtype)
    freeze_base(model)
    return targets

