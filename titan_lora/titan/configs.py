"""titan_lora's run sections (`titan_lora.run_sections`, taken as arguments) turned into the config objects
torchtitan 0.2.2's builders take: its optimizer, LR-scheduler, activation-checkpoint and compile sections,
and the JobConfig a model's args update from.

Part of the seam (`titan_lora.titan`): titan_lora owns its TOML schema and parses it itself, so a torchtitan
that reshapes its configs (0.3.0: no TOML, parameter groups, an AC union, a root `Trainer.Config`) changes
these functions, not a user's TOML.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, TypeVar

from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.config import JobConfig as TitanJobConfig
from torchtitan.config.job_config import ActivationCheckpoint, Compile, LRScheduler, Optimizer

__all__ = ["TORCH_DTYPE_MAP", "quiet_torchtitan_asset_warnings", "titan_ac", "titan_compile", "titan_job_config",
           "titan_lr_scheduler", "titan_optimizer"]

_Section = TypeVar("_Section")


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


def _as_titan(cls: type[_Section], section: Any) -> _Section:  # noqa: ANN401 (a titan_lora section)
    """torchtitan's section `cls` with the keys `section` shares with it; the others keep torchtitan's defaults."""
    return cls(**{f.name: getattr(section, f.name) for f in dataclasses.fields(cls) if hasattr(section, f.name)})


def titan_optimizer(section: Any) -> Optimizer:  # noqa: ANN401
    """`[optimizer]` as torchtitan's optimizer builder takes it."""
    return _as_titan(Optimizer, section)


def titan_lr_scheduler(section: Any) -> LRScheduler:  # noqa: ANN401
    """`[lr_scheduler]` as torchtitan's LR-scheduler builder takes it."""
    return _as_titan(LRScheduler, section)


def titan_ac(section: Any) -> ActivationCheckpoint:  # noqa: ANN401
    """`[activation_checkpoint]` as torchtitan's `apply_ac` takes it."""
    return _as_titan(ActivationCheckpoint, section)


def titan_compile(section: Any) -> Compile:  # noqa: ANN401
    """`[compile]` as torchtitan's `apply_compile` takes it."""
    return _as_titan(Compile, section)


def titan_job_config(job_config: Any) -> TitanJobConfig:  # noqa: ANN401 (titan_lora's JobConfig)
    """torchtitan's JobConfig with every key titan_lora's shares with it (a model's args `update_from_config`
    from it); torchtitan's other keys keep their defaults."""
    titan = TitanJobConfig()
    for section in dataclasses.fields(titan):
        if hasattr(job_config, section.name):
            ours = getattr(job_config, section.name)
            setattr(titan, section.name, _as_titan(type(getattr(titan, section.name)), ours))
    return titan
