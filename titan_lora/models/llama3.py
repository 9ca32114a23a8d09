"""The Llama 3 family: torchtitan's Llama3 with LoRA-aware parallelization, its HF names and RoPE rows.

`[model] name = "llama3"` loads any Llama-3.x checkpoint (`model_type = "llama"`) from `[model]
hf_assets_path`, its shape read from config.json; torchtitan's flavors (8B, 70B, ...) serve random-init
runs. SmolLM2 is this family with its own flavors and assets (`titan_lora.models.smollm2`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from titan_lora.export.peft import RopeRows, hf_module_names
from titan_lora.model_shape import DecoderShape, RopeScaling
from titan_lora.models.checkpoint import eos_id, require, rope_parameters, tied_embeddings
from titan_lora.models.family import ModelFamily
from titan_lora.titan.llama3 import LLAMA3 as ARCHITECTURE

# One source for the names: torchtitan's own state-dict adapter, which loads and exports the base.
HF_MODULES = hf_module_names(ARCHITECTURE.hf_weight_map())
MODEL = "Llama 3"
# The torchtitan modules of HF's q_proj and k_proj (`layers.{}.attention.qkv_linear.wq` on 0.3.0).
_Q, _K = ({titan for titan, hf in HF_MODULES.items() if hf.endswith(f".{leaf}")}.pop() for leaf in ("q_proj", "k_proj"))


def rope_rows(shape: DecoderShape) -> dict[str, RopeRows]:
    """q and k (wq, wk): torchtitan's Llama keeps their rows interleaved, HF rotate-half."""
    return {_Q: RopeRows(shape.n_heads, shape.head_dim), _K: RopeRows(shape.n_kv_heads, shape.head_dim)}


def _rope_scaling(rope: Mapping[str, Any]) -> RopeScaling | None:
    require(dict(rope), "rope_type", ("default", "llama3"), MODEL)
    if rope.get("rope_type", "default") == "default":
        return None
    return RopeScaling(factor=rope["factor"], low_freq_factor=rope["low_freq_factor"],
                       high_freq_factor=rope["high_freq_factor"],
                       original_max_position_embeddings=rope["original_max_position_embeddings"])


def shape_from_hf(config: Mapping[str, Any]) -> DecoderShape:
    """A Llama checkpoint's config.json as a shape."""
    config = dict(config)
    dim, heads = config["hidden_size"], config["num_attention_heads"]
    for key in ("attention_bias", "mlp_bias"):
        require(config, key, (False,), MODEL)
    require(config, "hidden_act", ("silu",), MODEL)
    config["head_dim"] = config.get("head_dim") or dim // heads
    require(config, "head_dim", (dim // heads,), MODEL)  # torchtitan's Llama derives it
    rope = rope_parameters(config)
    return DecoderShape(
        dim=dim, n_layers=config["num_hidden_layers"], n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads") or heads, head_dim=dim // heads,
        ffn_hidden_dim=config["intermediate_size"], vocab_size=config["vocab_size"],
        norm_eps=config.get("rms_norm_eps", 1e-5), rope_theta=rope["rope_theta"], rope_scaling=_rope_scaling(rope),
        tied=tied_embeddings(config), max_seq_len=config.get("max_position_embeddings", 131072),
        eos_id=eos_id(config, 0),
    )


def llama3_family(
    name: str,
    flavors: Mapping[str, DecoderShape],
    default_assets: Callable[[bool], Path] | None = None,
) -> ModelFamily:
    """A Llama 3 family under `name`: these flavors, Llama's names and RoPE rows, and its HF assets."""
    return ModelFamily(name, ARCHITECTURE, flavors, HF_MODULES, rope_rows, default_assets, model_types=("llama",),
                       shape_from_hf=shape_from_hf)


# torchtitan's own Llama 3 shapes; any Llama checkpoint by hf_assets_path.
LLAMA3 = llama3_family("llama3", ARCHITECTURE.flavors)
