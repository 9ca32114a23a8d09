"""torchtitan 0.3.0's Qwen3 (dense, and its MoE) as `Architecture`s: shapes to its config tree, its dense flavors as
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
from titan_lora.titan.decoder import decoder_config
from titan_lora.titan.models import architecture

__all__ = ["QWEN3", "QWEN3_MOE", "model_config"]


def model_config(shape: DecoderShape) -> Any:  # Qwen3Model.Config
    """`shape` as torchtitan's Qwen3 config tree; ValueError for what its Qwen3 cannot build."""
    if shape.rope_scaling is not None:
        raise ValueError("torchtitan's Qwen3 does not scale RoPE; this checkpoint needs another family")
    return decoder_config(shape, Qwen3Model, Qwen3TransformerBlock, complex_rope=False)


def _dense(flavor: str) -> bool:
    return "moe" not in flavor and "-A" not in flavor


QWEN3 = architecture("qwen3", model_config, Qwen3StateDictAdapter, qwen3_configs, include=_dense)
"""torchtitan's dense Qwen3 flavors (its MoE ones are left out); the HF map includes the MoE weights."""

QWEN3_MOE = architecture("qwen3_moe", model_config, Qwen3StateDictAdapter, qwen3_configs,
                         include=lambda flavor: not _dense(flavor))
"""torchtitan's Qwen3-MoE flavors (`debugmodel_moe`, `30B-A3B`, `235B-A22B`), same model class and HF map."""
