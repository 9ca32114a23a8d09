"""Build small titan_lora models inside test ranks from TOML text."""

from __future__ import annotations

import torch

from titan_lora.lora.layer import fill_param, lora_modules
from titan_lora.trainer.build import BuiltModel, build_from_toml
from titan_lora.trainer.job_config import job_config_from_toml

SMOLLM2_LORA = """
[model]
name = "smollm2"
flavor = "135M"
load_pretrained = true
converters = ["lora"]
[lora]
rank = 8
alpha = 16
target_modules = "all-linear"
[training]
seq_len = 64
mixed_precision_param = "float32"
[activation_checkpoint]
mode = "none"
"""

DEBUG_LORA = SMOLLM2_LORA.replace('flavor = "135M"', 'flavor = "debug"').replace(
    "load_pretrained = true", "load_pretrained = false"
)


def job_config_from(toml: str, *overrides: str):  # noqa: ANN201
    """Parse TOML text (plus CLI-style overrides) into the merged JobConfig."""
    return job_config_from_toml(toml, *overrides)


def build_from(toml: str, *overrides: str) -> BuiltModel:
    """Build the model of `toml` on this rank's CPU, sharded over the current process group."""
    return build_from_toml(toml, *overrides, device=torch.device("cpu"))


@torch.no_grad()
def randomize_adapters(model: torch.nn.Module, seed: int = 1, std: float = 0.05) -> None:
    """Give every adapter a non-zero, seeded B (and A), identical for any sharding."""
    for i, (_, m) in enumerate(lora_modules(model)):
        g = torch.Generator().manual_seed(seed * 7919 + i)
        fill_param(m.lora_A, torch.randn(m.lora_A.shape, generator=g) * std)
        fill_param(m.lora_B, torch.randn(m.lora_B.shape, generator=g) * std)
