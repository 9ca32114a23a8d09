"""titan_lora's run sections (`titan_lora.run_sections`, taken as arguments) turned into torchtitan 0.3.0's
config objects: its optimizer (parameter groups), LR-scheduler, activation-checkpoint policy, compile and
parallelism configs.

Part of the seam (`titan_lora.titan`): torchtitan 0.3.0 reads no TOML; titan_lora keeps parsing its own TOML
schema and builds these here, so a user's file does not change. Where 0.3.0 lost a setting titan_lora's
schema keeps, this module keeps its meaning: `[activation_checkpoint] selective_ac_option = N` (every N-th
block, gone from 0.3.0's per-op selective policy) is `EveryNthBlockAC`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch.nn as nn
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
from torchtitan.config import TORCH_DTYPE_MAP, CompileConfig, ParallelismConfig
from torchtitan.distributed.activation_checkpoint import (
    ActivationCheckpointing,
    FullAC,
    SelectiveAC,
)

__all__ = ["SPMD_BACKEND", "TORCH_DTYPE_MAP", "EveryNthBlockAC", "quiet_torchtitan_asset_warnings",
           "titan_ac", "titan_compile", "titan_lr_scheduler", "titan_optimizer", "titan_parallelism"]


class _TorchtitanAssetNoise(logging.Filter):
    """Drops a torchtitan warning that misleads here: a checkpoint without model.safetensors.index.json (a
    single-file checkpoint, which loads as it is)."""

    NOISE = "model.safetensors.index.json not found"

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.NOISE)


_ASSET_NOISE = _TorchtitanAssetNoise()


def quiet_torchtitan_asset_warnings() -> None:
    """Filter that warning out of torchtitan's logger (the root logger), once per process."""
    logging.getLogger().addFilter(_ASSET_NOISE)  # adding the same filter twice keeps one


ALL_PARAMS = ".*"
"""The one parameter group: every trainable parameter (titan_lora trains only the adapters)."""

SPMD_BACKEND = "partial_dtensor"
"""DTensors on the model-parallel axes only, FSDP on its own mesh: the path titan_lora's replicated adapters
and TP placements are built on (0.3.0's default `spmd_types` wants every parameter on the full mesh)."""


def titan_optimizer(section: Any, groups: Sequence[tuple[str, dict]] = ()) -> OptimizersContainer.Config:
    """`[optimizer]` as one catch-all parameter group of 0.3.0's optimizer container; with `groups`
    ((parameter-name pattern, optimizer keys) each), one group per pattern instead, in that order, each with
    its own keys (one optimizer, `section.name`, holds them all)."""
    if not groups:
        groups = [(ALL_PARAMS, {"lr": section.lr, "eps": section.eps, "weight_decay": section.weight_decay,
                                "betas": (section.beta1, section.beta2)})]
    return OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=pattern, optimizer_name=section.name, optimizer_kwargs=dict(kwargs))
                      for pattern, kwargs in groups],
        implementation=section.implementation,
    )


def titan_lr_scheduler(section: Any) -> LRSchedulersContainer.Config:  # [lr_scheduler]
    """`[lr_scheduler]`: 0.3.0 kept every key and its meaning."""
    return LRSchedulersContainer.Config(**{f.name: getattr(section, f.name) for f in dataclasses.fields(section)})


class EveryNthBlockAC(FullAC):
    """torchtitan 0.2.2's layer-wise selective checkpointing: full recompute of every N-th block (the
    N-th, 2N-th, ... counting from 1), which 0.3.0's per-op `SelectiveAC` no longer offers."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(FullAC.Config):
        every: int = 2

    def _wrap_block(self, module: nn.Module, *, base_fqn: str | None = None) -> nn.Module:
        """Full recompute of block `layers.<id>` when it is the N-th, 2N-th, ... (ids count from 0); the base's
        `apply` walks the blocks (and sets what every AC policy needs, as 0.2.2's `apply_ac` did)."""
        position = int((base_fqn or "").rsplit(".", 1)[-1]) + 1
        return super()._wrap_block(module, base_fqn=base_fqn) if position % self.config.every == 0 else module


def titan_ac(section: Any) -> ActivationCheckpointing.Config | None:  # [activation_checkpoint]
    """`[activation_checkpoint]` as a 0.3.0 policy config (`.build(dump_folder=...).apply(model)`), None for
    `mode = "none"`."""
    if section.mode == "none":
        return None
    if section.mode == "full":
        return FullAC.Config()
    if section.selective_ac_option == "op":
        return SelectiveAC.Config()
    return EveryNthBlockAC.Config(every=int(section.selective_ac_option))


def titan_compile(section: Any) -> CompileConfig:  # [compile]
    """`[compile]`: 0.3.0 kept its keys."""
    return CompileConfig(enable=section.enable, components=list(section.components), backend=section.backend)


def titan_parallelism(section: Any) -> ParallelismConfig:  # [parallelism]
    """`[parallelism]` on 0.3.0's partial-DTensor backend. `disable_loss_parallel` has no 0.3.0 key: the
    seam keeps the output head's logits whole itself (titan_lora's losses read whole-vocabulary rows)."""
    return ParallelismConfig(
        data_parallel_replicate_degree=section.data_parallel_replicate_degree,
        data_parallel_shard_degree=section.data_parallel_shard_degree,
        fsdp_reshard_after_forward=section.fsdp_reshard_after_forward,
        tensor_parallel_degree=section.tensor_parallel_degree,
        spmd_backend=SPMD_BACKEND,
    )
