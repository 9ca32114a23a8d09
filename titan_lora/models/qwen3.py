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
from titan_lora.model_shape import DecoderShape
from titan_lora.models.checkpoint import eos_id, require, rope_parameters, tied_embeddings
from titan_lora.models.family import ModelFamily
from titan_lora.titan.qwen3 import QWEN3 as ARCHITECTURE

MODEL = "Qwen3 (dense)"
IM_END = 151645
"""Qwen3's end-of-turn token (`<|im_end|>`), its end of sequence when config.json names none."""
# The dense modules of torchtitan's own state-dict adapter (its map also names the MoE router).
HF_MODULES = {titan: hf for titan, hf in
              hf_module_names(ARCHITECTURE.hf_weight_map()).items()
              if ".moe." not in titan}

FLAVORS: dict[str, DecoderShape] = {
    **ARCHITECTURE.flavors,
    # Random-init, for fast tests: head_dim 32 != dim / n_heads = 16, GQA, Qwen3's vocabulary (it holds
    # SmolLM2's tokenizer too); 32 is the smallest head size vLLM's CPU attention serves.
    "debug": DecoderShape(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_hidden_dim=128,
                          vocab_size=151936, norm_eps=1e-6, rope_theta=1e6, qk_norm=True, tied=True,
                          max_seq_len=4096, eos_id=IM_END),
}


def rope_rows(shape: DecoderShape) -> dict[str, RopeRows]:
    """None: torchtitan's Qwen3 keeps q/k rows in HF's rotate-half order."""
    return {}


def shape_from_hf(config: Mapping[str, Any]) -> DecoderShape:
    """A dense Qwen3 checkpoint's config.json as a shape."""
    config = dict(config)
    require(config, "attention_bias", (False,), MODEL)
    require(config, "hidden_act", ("silu",), MODEL)
    require(config, "use_sliding_window", (False,), MODEL)
    rope = rope_parameters(config)
    require(rope, "rope_type", ("default",), MODEL)
    heads = config["num_attention_heads"]
    return DecoderShape(
        dim=config["hidden_size"], n_layers=config["num_hidden_layers"], n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        ffn_hidden_dim=config["intermediate_size"], vocab_size=config["vocab_size"],
        norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=rope["rope_theta"], qk_norm=True,
        tied=tied_embeddings(config), max_seq_len=config.get("max_position_embeddings", 4096),
        eos_id=eos_id(config, IM_END),
    )


QWEN3 = ModelFamily("qwen3", ARCHITECTURE, FLAVORS, HF_MODULES, rope_rows, model_types=("qwen3",),
                    shape_from_hf=shape_from_hf)
