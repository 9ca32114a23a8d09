"""torchtitan 0.3.0's Llama 3 as an `Architecture`: shapes to its config tree, its flavors as shapes, its HF
names.

Part of the seam (`titan_lora.titan`): 0.3.0 fuses q/k/v and uses flex attention in its own flavors; the
trees built here are unfused (`SplitQKVLinear`) with SDPA (`titan_lora.titan.decoder`).
"""

from __future__ import annotations

from typing import Any

from torchtitan.models.llama3 import llama3_configs
from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

from titan_lora.model_shape import DecoderShape
from titan_lora.titan.decoder import decoder_config
from titan_lora.titan.models import architecture

__all__ = ["LLAMA3", "model_config"]


def model_config(shape: DecoderShape) -> Any:  # Llama3Model.Config
    """`shape` as torchtitan's Llama config tree; ValueError for what its Llama cannot build."""
    if shape.head_dim * shape.n_heads != shape.dim:
        raise ValueError(f"torchtitan's Llama derives head_dim = dim / n_heads = {shape.dim // shape.n_heads}, "
                         f"but the shape asks for {shape.head_dim}; this checkpoint needs another family")
    if shape.qk_norm:
        raise ValueError("torchtitan's Llama has no q/k norms; this checkpoint needs another family (qwen3)")
    return decoder_config(shape, Llama3Model, Llama3TransformerBlock, complex_rope=True)


LLAMA3 = architecture("llama3", model_config, Llama3StateDictAdapter, llama3_configs)
