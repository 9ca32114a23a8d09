"""The Qwen3 dense family: torchtitan's Qwen3 (q/k norms, head_dim free of dim / n_heads) with LoRA.

`[model] name = "qwen3"` loads any dense Qwen3 checkpoint (`model_type = "qwen3"`) from `[model]
hf_assets_path`, its shape read from config.json. torchtitan's Qwen3 applies RoPE in rotate-half order,
as HF does, so no lora_B rows are permuted on export (tests/export/test_family_parity.py checks it
against HF + peft). TP follows torchtitan's own Qwen3 plan (q/k norms sequence-parallel over heads).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from titan_lora.export.peft import RopeRows, hf_module_names
from titan_lora.models.checkpoint import eos_id, require, rope_parameters, tied_embeddings
from titan_lora.models.family import ModelFamily, lora_train_spec
from titan_lora.titan.qwen3 import (
    Qwen3ModelArgs,
    hf_weight_map,
    qwen3_args,
    qwen3_train_spec,
    tensor_parallel,
)

MODEL = "Qwen3 (dense)"
# The dense modules of torchtitan's own state-dict adapter (its map also names the MoE router).
HF_MODULES = {titan: hf for titan, hf in
              hf_module_names(hf_weight_map()).items()
              if ".moe." not in titan}

FLAVORS: dict[str, Qwen3ModelArgs] = {
    **{name: args for name, args in qwen3_args.items() if not args.moe_enabled},
    # Random-init, for fast tests: head_dim 32 != dim / n_heads = 16, GQA, Qwen3's vocabulary (it holds
    # SmolLM2's tokenizer too); 32 is the smallest head size vLLM's CPU attention serves.
    "debug": Qwen3ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=128,
                            vocab_size=151936, max_seq_len=4096, qk_norm=True, rope_theta=1e6,
                            enable_weight_tying=True),
}


def rope_rows(args: Qwen3ModelArgs) -> dict[str, RopeRows]:
    """None: torchtitan's Qwen3 keeps q/k rows in HF's rotate-half order."""
    return {}


def args_from_hf(config: Mapping[str, Any]) -> Qwen3ModelArgs:
    """A dense Qwen3 checkpoint's config.json as torchtitan's model args."""
    config = dict(config)
    require(config, "attention_bias", (False,), MODEL)
    require(config, "hidden_act", ("silu",), MODEL)
    require(config, "use_sliding_window", (False,), MODEL)
    rope = rope_parameters(config)
    require(rope, "rope_type", ("default",), MODEL)
    heads = config["num_attention_heads"]
    return Qwen3ModelArgs(
        dim=config["hidden_size"], n_layers=config["num_hidden_layers"], n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads") or heads, vocab_size=config["vocab_size"],
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        hidden_dim=config["intermediate_size"], norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope["rope_theta"], qk_norm=True,
        max_seq_len=config.get("max_position_embeddings", 4096),
        eos_id=eos_id(config, Qwen3ModelArgs.eos_id),
        enable_weight_tying=tied_embeddings(config),
    )


QWEN3 = ModelFamily("qwen3", lora_train_spec(qwen3_train_spec(), FLAVORS, tensor_parallel), HF_MODULES,
                    rope_rows, model_types=("qwen3",), args_from_hf=args_from_hf)
