"""Build the (LoRA, sharded, initialised, optionally pretrained) model the way torchtitan's Trainer does.

torchtitan's parts (the family's architecture, converters, ParallelDims) come through the seam (`titan_lora.titan`)."""

from __future__ import annotations

import dataclasses
import logging
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from titan_lora.config import JobConfig
from titan_lora.export.peft import PeftLayout
from titan_lora.lora.layer import freeze_base
from titan_lora.lora.parallelize import add_grad_hooks
from titan_lora.models.family import FamilyLoRAConverter  # noqa: F401 (registers the "lora" converter)
from titan_lora.models.load import load_base_weights
from titan_lora.models.resolve import ResolvedModel, resolve_model
from titan_lora.titan.configs import titan_parallelism
from titan_lora.titan.converters import model_converters
from titan_lora.titan.models import StateDictAdapter
from titan_lora.titan.parallel import ParallelDims, build_parallel_dims

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class BuiltModel:
    """The model and the torchtitan parts that describe it."""

    model: nn.Module
    sd_adapter: StateDictAdapter
    hf_dir: str
    """HF checkpoint directory (weights, config, tokenizer) of the base model."""
    peft_layout: PeftLayout
    """The family's PEFT naming and RoPE rows for this model, for the export and the sync."""
    tied: bool
    """The output head is the embedding (`ResolvedModel.tied`): the base stream leaves lm_head out."""


def build_model(job_config: JobConfig, parallel_dims: ParallelDims, device: torch.device,
                resolved: ResolvedModel | None = None) -> BuiltModel:
    """Meta-init, convert (LoRA), parallelize, materialise on `device`, init, load pretrained weights.

    `resolved` is `[model]` as `load_job` resolved and checked it (None: resolved here)."""
    resolved = resolved or resolve_model(job_config.model)
    family, shape, hf_dir = resolved.family, resolved.shape, resolved.hf_dir
    # 0.3.0: converters rewrite the config tree, and `[parallelism]` fills its shardings, before the build.
    model = family.architecture.meta_model(
        shape, job_config, model_converters(job_config, parallel_dims),
        parallelism=titan_parallelism(job_config.parallelism) if parallel_dims.tp_enabled else None)
    if "lora" in job_config.model.converters:
        freeze_base(model)  # before FSDP wraps: it reads requires_grad (no LoRA: full fine-tuning)
    model = family.parallelize(model, parallel_dims, job_config)
    model.to_empty(device=device)
    with torch.no_grad(), warnings.catch_warnings():
        if resolved.load_pretrained:
            # On a CPU mesh, DTensor draws the sharded base's random init from each rank's own RNG and
            # warns so on every rank; harmless here: load_base_weights replaces every base weight below
            # (or fails), and the adapters come from their own seeded generator (their param_init).
            warnings.filterwarnings("ignore", "DTensor random operators may not have complete support",
                                    UserWarning)
        model.init_weights(buffer_device=None)
    add_grad_hooks(model, parallel_dims, job_config)
    sd_adapter = family.architecture.state_dict_adapter(shape, hf_dir)
    if resolved.load_pretrained:
        load_base_weights(model, hf_dir, sd_adapter, resolved.tied)
        logger.info("loaded pretrained weights from %s", hf_dir)
    model.train()
    return BuiltModel(model=model, sd_adapter=sd_adapter, hf_dir=hf_dir,
                      peft_layout=family.peft_layout(shape), tied=resolved.tied)


def build_from_toml(toml: str, *overrides: str, device: torch.device | None = None) -> BuiltModel:
    """Build the model a TOML text describes on this process group (started if needed: 1 rank)."""
    from titan_lora.trainer.distributed import device_for_rank, init_distributed
    from titan_lora.trainer.job_config import job_from_toml

    cfg, resolved = job_from_toml(toml, *overrides)
    device = device or device_for_rank()
    init_distributed(device)
    dims = build_parallel_dims(cfg.parallelism, dist.get_world_size(), device)
    return build_model(cfg, dims, device, resolved)
