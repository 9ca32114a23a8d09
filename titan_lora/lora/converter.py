"""The LoRA model converter: `[model] converters = ["lora"]` applies `[lora]` to the model.

torchtitan builds converters from the job config alone; `titan_lora.models.family` registers the
"lora" name with the leaf names of the family that `[model] name` selects. On torchtitan 0.3.0 a converter
rewrites the model's config tree before the build.
"""

from __future__ import annotations

import logging

from collections.abc import Sequence

from titan_lora.config import JobConfig, LoRA, validate_lora
from titan_lora.config_adapters import Adapter, job_adapters
from titan_lora.lora.layer import lora_class, lora_experts_mixin, lora_scale
from titan_lora.lora.multi import multi_lora_class
from titan_lora.lora.targets import EXPERTS, LeafNames, resolve_target_names
from titan_lora.titan.lora_experts import ExpertsLoRAConverter
from titan_lora.titan.lora_linear import LoRAConfigConverter
from titan_lora.titan.multi_lora_linear import AdapterTargets, MultiLoRAConfigConverter
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
        self.adapters = job_adapters(job_config) if len(job_config.adapters) > 1 else []

    def convert(self, model_config):  # noqa: ANN001, ANN201 (torchtitan's config tree)
        """The tree with the targeted linears as LoRA linears (the base is frozen once built: `freeze_base`);
        with several `[[adapters]]`, as K-adapter linears."""
        if self.adapters:
            if any(EXPERTS in a.target_modules for a in self.adapters):
                raise ValueError("[[adapters]] cannot target `experts` yet: several adapters on routed experts "
                                 "are not built; adapt the experts in a one-adapter job ([lora] target_modules)")
            multi = multi_lora_converter(self.adapters, self.cfg, self.names, self.seed)
            model_config = multi(model_config)
            for adapter, targets in zip(self.adapters, multi.targets):
                logger.info("adapter %s: LoRA rank %d alpha %g on %d linears (%s)", adapter.name, adapter.rank,
                            adapter.alpha, len(targets), adapter.target_modules)
            return model_config
        converter = lora_converter(self.cfg, self.names, self.seed)
        model_config = converter(model_config)
        self.targets = converter.targets
        if EXPERTS in self.cfg.target_modules:
            experts = experts_converter(self.cfg, self.seed, first_index=len(self.targets))
            model_config = experts(model_config)
            self.targets = self.targets + experts.targets
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


def experts_converter(cfg: LoRA, seed: int = 0, first_index: int = 0) -> ExpertsLoRAConverter:
    """`[lora]` on every routed expert (`experts` in target_modules) as a config-tree converter (it refuses a
    model without routed experts), seeded after the `first_index` LoRA linears."""
    return ExpertsLoRAConverter(
        experts_mixin=lora_experts_mixin, rank=cfg.rank, scale=lora_scale(cfg.rank, cfg.alpha, cfg.use_rslora),
        dropout=cfg.dropout, dtype=cfg.dtype, seed=seed, first_index=first_index)


def multi_lora_converter(adapters: Sequence[Adapter], cfg: LoRA, names: LeafNames,
                         seed: int = 0) -> MultiLoRAConfigConverter:
    """Resolved `[[adapters]]` as one config-tree converter of K-adapter linears: each adapter's own targets,
    rank and scale, every adapter initialised with `seed` as a one-adapter job with its keys would be."""
    dropouts = {a.dropout for a in adapters}
    if len(dropouts) > 1:
        raise ValueError(f"[[adapters]] set dropouts {sorted(dropouts)}; one dropout applies to every adapter of "
                         "a linear: set the same dropout in each table, or only [lora] dropout")
    return MultiLoRAConfigConverter(
        multi_class=multi_lora_class,
        adapters=[AdapterTargets(select=lambda linears, t=a.target_modules: resolve_target_names(linears, t, names),
                                 rank=a.rank, scale=lora_scale(a.rank, a.alpha, a.use_rslora), seed=seed)
                  for a in adapters],
        dropout=dropouts.pop(), dtype=cfg.dtype)
