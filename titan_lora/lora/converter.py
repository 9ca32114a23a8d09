"""The LoRA model converter: `[model] converters = ["lora"]` applies `[lora]` to the model.

torchtitan builds converters from the job config alone; `titan_lora.models.family` registers the
"lora" name with the leaf names of the family that `[model] name` selects. On torchtitan 0.3.0 a converter
rewrites the model's config tree before the build.
"""

from __future__ import annotations

import logging

from titan_lora.config import JobConfig, LoRA, validate_lora
from titan_lora.lora.layer import lora_class, lora_scale
from titan_lora.lora.targets import LeafNames, resolve_target_names
from titan_lora.titan.lora_linear import LoRAConfigConverter
from titan_lora.titan.parallel import ParallelDims

logger = logging.getLogger(__name__)


class LoRAConverter:
    """The "lora" model converter: rewrites the targeted linears of the model's config tree into LoRA linears
    (`titan_lora.titan.lora_linear`), their adapters initialised by the build (kaiming-uniform A from a
    per-module seeded generator, zero B)."""

    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims, names: LeafNames) -> None:
        self.cfg: LoRA = job_config.lora
        self.names = names
        validate_lora(self.cfg)
        self.seed = job_config.debug.seed or 0
        self.targets: list[str] = []

    def convert(self, model_config):  # noqa: ANN001, ANN201 (torchtitan's config tree)
        """The tree with the targeted linears as LoRA linears (the base is frozen once built: `freeze_base`)."""
        converter = lora_converter(self.cfg, self.names, self.seed)
        model_config = converter(model_config)
        self.targets = converter.targets
        logger.info(
            "LoRA rank %d alpha %g on %d linears (%s)",
            self.cfg.rank, self.cfg.alpha, len(self.targets), self.cfg.target_modules,
        )
        return model_config



def lora_converter(cfg: LoRA, names: LeafNames, seed: int = 0) -> LoRAConfigConverter:
    """`[lora]` as a config-tree converter (`Architecture.meta_model(..., converters=[...])`): the targeted
    linears of `names`' family become LoRA linears, adapters seeded per module (seed, index)."""
    return LoRAConfigConverter(
        lora_class=lora_class, select=lambda linears: resolve_target_names(linears, cfg.target_modules, names),
        rank=cfg.rank, scale=lora_scale(cfg.rank, cfg.alpha, cfg.use_rslora), dropout=cfg.dropout, dtype=cfg.dtype,
        seed=seed)
