"""The model converters `[model] converters` names (titan_lora's "lora" is registered here), applied to the
model while it is built, in the order named.

Part of the seam (`titan_lora.titan`): torchtitan 0.2.2's converters mutate the built model
(`cls(job_config, parallel_dims).convert(model)`); 0.3.0's rewrite the model's config tree before the build
(`ModelConfigConverter`). Its own converters (float8, mx) are not offered: they read torchtitan's `[quantize]`,
which titan_lora's schema does not have, and its LoRA linears are not quantized.
"""

from __future__ import annotations

import torch.nn as nn
from torchtitan.distributed import ParallelDims

_CONVERTERS: dict[str, type] = {}


def register_converter(cls: type, name: str) -> None:
    """Register `cls` (built as `cls(job_config, parallel_dims)`, then `.convert(model)`) as
    `[model] converters = [name]`."""
    if name in _CONVERTERS and _CONVERTERS[name] is not cls:
        raise ValueError(f"a model converter {name!r} is already registered ({_CONVERTERS[name].__qualname__})")
    _CONVERTERS[name] = cls


def registered_converters() -> list[str]:
    """The names `[model] converters` accepts, sorted."""
    return sorted(_CONVERTERS)


def convert_model(model: nn.Module, job_config, parallel_dims: ParallelDims) -> None:  # noqa: ANN001
    """Apply `[model] converters` to the meta-device model, in place."""
    for name in job_config.model.converters:
        _CONVERTERS[name](job_config, parallel_dims).convert(model)
