"""The model converters `[model] converters` names (titan_lora's "lora" is registered here), applied to the
model's config tree before it is built, in the order named.

Part of the seam (`titan_lora.titan`): torchtitan 0.3.0's converters rewrite the model's config tree before
the build (`ModelConfigConverter.convert(model_config) -> model_config`); 0.2.2's mutated the built model.
Its own converters (float8, mx) are not offered: they read settings titan_lora's schema does not have, and
its LoRA linears are not quantized.
"""

from __future__ import annotations

from typing import Any

from torchtitan.distributed import ParallelDims

from titan_lora.titan.models import ConfigConverter

_CONVERTERS: dict[str, type] = {}


def register_converter(cls: type, name: str) -> None:
    """Register `cls` (built as `cls(job_config, parallel_dims)`, then `.convert(model_config)`) as
    `[model] converters = [name]`."""
    if name in _CONVERTERS and _CONVERTERS[name] is not cls:
        raise ValueError(f"a model converter {name!r} is already registered ({_CONVERTERS[name].__qualname__})")
    _CONVERTERS[name] = cls


def registered_converters() -> list[str]:
    """The names `[model] converters` accepts, sorted."""
    return sorted(_CONVERTERS)


def model_converters(job_config: Any, parallel_dims: ParallelDims | None) -> list[ConfigConverter]:
    """`[model] converters`, each as a config-tree rewrite (`Architecture.model_config` applies them)."""
    return [_CONVERTERS[name](job_config, parallel_dims).convert for name in job_config.model.converters]
