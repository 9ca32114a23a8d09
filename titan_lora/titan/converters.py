"""torchtitan's model-converter protocol: the names `[model] converters` accepts, and the hook that applies
them to the model while it is built (titan_lora's "lora" converter is registered through it).

Part of the seam (`titan_lora.titan`): 0.3.0 replaces this registry with converters that rewrite the model's
config tree before the build (`ModelConfigConverter`).
"""

from __future__ import annotations

import torch.nn as nn
from torchtitan.distributed import ParallelDims
from torchtitan.protocols.model_converter import (
    _registry_model_converter_cls,
    build_model_converters,
    register_model_converter,
)


def register_converter(cls: type, name: str) -> None:
    """Register `cls` (built as `cls(job_config, parallel_dims)`) as `[model] converters = [name]`."""
    register_model_converter(cls, name)


def registered_converters() -> list[str]:
    """The names `[model] converters` accepts, sorted."""
    return sorted(_registry_model_converter_cls)


def convert_model(model: nn.Module, job_config, parallel_dims: ParallelDims) -> None:  # noqa: ANN001
    """Apply `[model] converters` to the meta-device model, in place."""
    build_model_converters(job_config, parallel_dims).convert(model)
