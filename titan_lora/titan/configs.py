"""torchtitan's JobConfig: the schema that titan_lora's own parser (`trainer/toml_config.py`) fills, its
sections with titan_lora's merged in, and what torchtitan's ConfigManager did after parsing.

Part of the seam (`titan_lora.titan`): 0.3.0 drops TOML and `--job.custom_config_module` for Python config
functions; titan_lora already parses TOML and overrides itself, so only the schema comes from here.
"""

from __future__ import annotations

import logging
from typing import Any

from torchtitan.config import TORCH_DTYPE_MAP, ConfigManager, JobConfig
from torchtitan.config.job_config import Model as TitanModelSection

__all__ = ["TITAN_DEFAULT_ASSETS", "TORCH_DTYPE_MAP", "after_parse", "merged_schema",
           "quiet_torchtitan_asset_warnings"]

logger = logging.getLogger(__name__)

TITAN_DEFAULT_ASSETS: str = TitanModelSection().hf_assets_path
"""torchtitan's default `[model] hf_assets_path` (a path that exists only in a torchtitan checkout)."""


class _TorchtitanAssetNoise(logging.Filter):
    """Drops two torchtitan warnings that mislead here: its default `hf_assets_path` missing (a titan_lora
    family finds its own assets, or `resolve_model` names the fix when `[model] hf_assets_path` is needed),
    and a checkpoint without model.safetensors.index.json (a single-file checkpoint, which loads as it is)."""

    NOISE = (f"HF assets path {TITAN_DEFAULT_ASSETS} does not exist", "model.safetensors.index.json not found")

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.NOISE)


_ASSET_NOISE = _TorchtitanAssetNoise()


def quiet_torchtitan_asset_warnings() -> None:
    """Filter those two warnings out of torchtitan's logger (the root logger), once per process."""
    logging.getLogger().addFilter(_ASSET_NOISE)  # adding the same filter twice keeps one


def merged_schema(custom: type) -> type:
    """torchtitan's JobConfig class with `custom`'s sections merged in, as ConfigManager builds it."""
    return ConfigManager._merge_configs(JobConfig, custom)


def after_parse(job_config: Any) -> None:  # noqa: ANN401 (a class made at run time)
    """What torchtitan 0.2.2's ConfigManager did to a parsed config that still matters here: its deprecated
    `[model] tokenizer_path` replaces `hf_assets_path`. (Its "HF assets path ... does not exist" warning was
    dropped while parsing: `resolve_model` names a missing checkpoint with the fix.)"""
    if job_config.model.tokenizer_path:
        logger.warning("[model] tokenizer_path is deprecated (torchtitan 0.2.2): hf_assets_path is set to it; "
                       "write [model] hf_assets_path = %r instead", job_config.model.tokenizer_path)
        job_config.model.hf_assets_path = job_config.model.tokenizer_path
