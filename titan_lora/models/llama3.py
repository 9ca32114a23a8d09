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
from titan_lora.models.checkpoint import eos_id, require, rope_parameters
from titan_lora.models.family import ModelFamily, lora_train_spec
from titan_lora.titan.llama3 import (
    RoPEScalingArgs,
    TransformerModelArgs,
    hf_weight_map,
    llama3_args,
    llama3_train_spec,
    tensor_parallel,
)

# One source for the names: torchtitan's own state-dict adapter, which loads and exports the base.
HF_MODULES = hf_module_names(hf_weight_map())
MODEL = "Llama 3"


def rope_rows(args: TransformerModelArgs) -> dict[str, RopeRows]:
    """wq, wk: torchtitan's Llama keeps their rows interleaved, HF rotate-half; head_dim = dim / n_heads."""
    head_dim = args.dim // args.n_heads
    return {"layers.{}.attention.wq": RopeRows(args.n_heads, head_dim),
            "layers.{}.attention.wk": RopeRows(args.n_kv_heads or args.n_heads, head_dim)}


def _rope_scaling(rope: Mapping[str, Any]) -> RoPEScalingArgs:
    require(dict(rope), "rope_type", ("default", "llama3"), MODEL)
    if rope.get("rope_type", "default") == "default":
        return RoPEScalingArgs(scaling_factor=1.0)  # 1 turns torchtitan's Llama-3.1 scaling off
    return RoPEScalingArgs(scaling_factor=rope["factor"], low_freq_factor=rope["low_freq_factor"],
                           high_freq_factor=rope["high_freq_factor"],
                           original_max_position_embeddings=rope["original_max_position_embeddings"])


def args_from_hf(config: Mapping[str, Any]) -> TransformerModelArgs:
    """A Llama checkpoint's config.json as torchtitan's model args."""
    config = dict(config)
    dim, heads, ffn = config["hidden_size"], config["num_attention_heads"], config["intermediate_size"]
    for key in ("attention_bias", "mlp_bias"):
        require(config, key, (False,), MODEL)
    require(config, "hidden_act", ("silu",), MODEL)
    config["head_dim"] = config.get("head_dim") or dim // heads
    require(config, "head_dim", (dim // heads,), MODEL)  # torchtitan's Llama derives it
    # torchtitan sizes the FFN as multiple_of * ceil(m * int(8 dim / 3) / multiple_of): with
    # multiple_of = intermediate_size and m <= 1, that is exactly intermediate_size.
    base = int(2 * 4 * dim / 3)
    return TransformerModelArgs(
        dim=dim, n_layers=config["num_hidden_layers"], n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads") or heads, vocab_size=config["vocab_size"],
        multiple_of=ffn, ffn_dim_multiplier=ffn / base if base > ffn else None,
        norm_eps=config.get("rms_norm_eps", 1e-5), rope_theta=rope_parameters(config)["rope_theta"],
        rope_scaling_args=_rope_scaling(rope_parameters(config)),
        max_seq_len=config.get("max_position_embeddings", 131072),
        eos_id=eos_id(config, 0),
    )


def llama3_family(
    name: str,
    flavors: Mapping[str, TransformerModelArgs],
    default_assets: Callable[[bool], Path] | None = None,
) -> ModelFamily:
    """A Llama 3 family under `name`: these flavors, Llama's names and RoPE rows, and its HF assets."""
    spec = lora_train_spec(llama3_train_spec(), flavors, tensor_parallel)
    return ModelFamily(name, spec, HF_MODULES, rope_rows, default_assets, model_types=("llama",),
                       args_from_hf=args_from_hf)


# torchtitan's own Llama 3 shapes with LoRA-aware parallelization; any Llama checkpoint by hf_assets_path.
LLAMA3 = llama3_family("llama3", llama3_args)
