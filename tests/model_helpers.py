"""Build small titan_lora models inside test ranks from TOML text."""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist

from titan_lora.lora.layer import fill_param, lora_modules
from titan_lora.trainer.build import BuiltModel, build_model
from titan_lora.trainer.distributed import build_parallel_dims, init_distributed
from titan_lora.trainer.job_config import load_job_config

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
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(toml)
    return load_job_config(["--job.config_file", f.name, *overrides])


def build_from(toml: str, *overrides: str) -> BuiltModel:
    """Build the model of `toml` on this rank's CPU, sharded over the current process group."""
    cfg = job_config_from(toml, *overrides)
    init_distributed(torch.device("cpu"))  # a no-op inside run_ranks; a 1-rank group otherwise
    dims = build_parallel_dims(cfg.parallelism, dist.get_world_size(), torch.device("cpu"))
    return build_model(cfg, dims, torch.device("cpu"))


@torch.no_grad()
def randomize_adapters(model: torch.nn.Module, seed: int = 1, std: float = 0.05) -> None:
    """Give every adapter a non-zero, seeded B (and A), identical for any sharding."""
    for i, (_, m) in enumerate(lora_modules(model)):
        g = torch.Generator().manual_seed(seed * 7919 + i)
        fill_param(m.lora_A, torch.randn(m.lora_A.shape, generator=g) * std)
        fill_param(m.lora_B, torch.randn(m.lora_B.shape, generator=g) * std)
