"""torchtitan's JobConfig: its sections with titan_lora's merged in, parsed from TOML and CLI overrides.

Part of the seam (`titan_lora.titan`): 0.3.0 drops TOML and `--job.custom_config_module` for Python config
functions, so this is where titan_lora's own loader will take over.
"""

from __future__ import annotations

import logging
from typing import Any

from torchtitan.config import TORCH_DTYPE_MAP, ConfigManager, JobConfig
from torchtitan.config.job_config import Model as TitanModelSection

__all__ = ["TITAN_DEFAULT_ASSETS", "TORCH_DTYPE_MAP", "merged_schema", "parse_job_config",
           "quiet_torchtitan_asset_warnings"]

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


class _MissingAssets(logging.Filter):
    """Drops torchtitan's "HF assets path ... does not exist!" while parsing: `resolve_model` refuses a
    checkpoint that is missing with the key and the fix, in one line; the warning would come first."""

    def filter(self, record: logging.LogRecord) -> bool:
        """False for that warning."""
        return not record.getMessage().startswith("HF assets path ")


_MISSING_ASSETS = _MissingAssets()


def merged_schema(custom: type) -> type:
    """torchtitan's JobConfig class with `custom`'s sections merged in, as ConfigManager builds it."""
    return ConfigManager._merge_configs(JobConfig, custom)


def parse_job_config(argv: list[str], custom_module: str) -> Any:  # noqa: ANN401 (a class made at run time)
    """`argv` (`--job.config_file x.toml`, `--section.key value` overrides) parsed by torchtitan into the
    JobConfig merged with the sections of `custom_module` (a module name)."""
    quiet_torchtitan_asset_warnings()  # torchtitan warns while parsing and building
    root = logging.getLogger()  # torchtitan's logger
    root.addFilter(_MISSING_ASSETS)
    try:
        return ConfigManager().parse_args([*argv, f"--job.custom_config_module={custom_module}"])
    finally:
        root.removeFilter(_MISSING_ASSETS)
