"""torchtitan 0.3.0's Qwen3 (dense) as an `Architecture`: shapes to its config tree, its dense flavors as
shapes, its HF names.

Part of the seam (`titan_lora.titan`): trees built here are unfused (`SplitQKVLinear`) with SDPA and
rotate-half RoPE (`CosSinRoPE`, HF's layout: no row permutation).
"""

from __future__ import annotations

from typing import Any

from torchtitan.models.qwen3 import qwen3_configs
from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

from titan_lora.model_shape import DecoderShape
from titan_lora.titan.decoder import decoder_config, shape_of_config
from titan_lora.titan.models import Architecture

__all__ = ["QWEN3", "model_config", "shape_of"]

ATTENTION = "flex"


def model_config(shape: DecoderShape) -> Any:  # noqa: ANN401 (Qwen3Model.Config)
    """`shape` as torchtitan's Qwen3 config tree; ValueError for what its Qwen3 cannot build."""
    if shape.rope_scaling is not None:
        raise ValueError("torchtitan's Qwen3 does not scale RoPE; this checkpoint needs another family")
    return decoder_config(shape, Qwen3Model, Qwen3TransformerBlock, complex_rope=False)


def shape_of(config: Any) -> DecoderShape:  # noqa: ANN401
    """torchtitan's (dense) Qwen3 config tree as a shape."""
    return shape_of_config(config)


def _titan_flavor(name: str):  # noqa: ANN202
    return lambda: qwen3_configs[name](attn_backend=ATTENTION)


def _dense(name: str) -> bool:
    return "moe" not in name and "-A" not in name


def hf_weight_map() -> dict[str, str | None]:
    """HF weight name -> torchtitan's (`{}` for the layer), from torchtitan's own Qwen3 state-dict adapter
    (MoE weights included)."""
    return dict(Qwen3StateDictAdapter(qwen3_configs["debugmodel"](attn_backend=ATTENTION), None).from_hf_map)


_FLAVORS = {name: _titan_flavor(name) for name in qwen3_configs if _dense(name)}
QWEN3 = Architecture(
    "qwen3", model_config, Qwen3StateDictAdapter,
    flavors={name: shape_of(make()) for name, make in _FLAVORS.items()},
    titan_flavors=_FLAVORS, hf_weight_map=hf_weight_map,
)
