"""The Qwen3-MoE family: torchtitan's Qwen3 with routed experts (softmax top-k), LoRA on attention, dense parts
and experts.

`[model] name = "qwen3_moe"` loads any Qwen3-MoE checkpoint (`model_type = "qwen3_moe"`: Qwen3-30B-A3B,
Qwen3-235B-A22B and their fine-tunes) from `[model] hf_assets_path`, its shape read from config.json (layers
in `mlp_only_layers` or off `decoder_sparse_step` are dense). The router (`gate`) is never adapted: LoRA keeps
the base model's routing. Experts are adapted as `experts` in `[lora] target_modules` (every expert's gate,
up and down projections, one rank-r adapter per expert: docs/models.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from titan_lora.export.peft import hf_module_names
from titan_lora.model_shape import DecoderShape, MoEShape
from titan_lora.models.family import ModelFamily
from titan_lora.models.qwen3 import IM_END, rope_rows
from titan_lora.models.qwen3 import shape_from_hf as dense_shape_from_hf
from titan_lora.titan.qwen3 import QWEN3_MOE as ARCHITECTURE

MODEL = "Qwen3-MoE"
# torchtitan's own map, its per-expert weights replaced by the experts module: PEFT adapts HF's fused expert
# parameters on it (`model.layers.{}.mlp.experts`), and `[lora] target_modules` names it `experts`.
HF_MODULES = {**{titan: hf for titan, hf in hf_module_names(ARCHITECTURE.hf_weight_map()).items()
                 if ".experts." not in hf},
              "layers.{}.moe.routed_experts.inner_experts": "model.layers.{}.mlp.experts"}

FLAVORS: dict[str, DecoderShape] = {
    **ARCHITECTURE.flavors,
    # Random-init, for fast tests: 4 experts of width 32, top 2, a dense layer 1; Qwen3's vocabulary.
    "debug": DecoderShape(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_hidden_dim=96,
                          vocab_size=151936, norm_eps=1e-6, rope_theta=1e6, qk_norm=True, tied=True,
                          max_seq_len=4096, eos_id=IM_END,
                          moe=MoEShape(num_experts=4, top_k=2, hidden_dim=32, norm_topk_prob=True,
                                       dense_layers=(1,))),
}


def dense_layers(config: Mapping[str, Any], n_layers: int) -> tuple[int, ...]:
    """The layers HF's Qwen3-MoE builds dense: listed in `mlp_only_layers`, or off `decoder_sparse_step`."""
    step = config.get("decoder_sparse_step", 1) or 1
    listed = set(config.get("mlp_only_layers") or ())
    return tuple(i for i in range(n_layers) if i in listed or (i + 1) % step)


def shape_from_hf(config: Mapping[str, Any]) -> DecoderShape:
    """A Qwen3-MoE checkpoint's config.json as a shape."""
    config = dict(config)
    experts = config.get("num_experts", config.get("num_local_experts"))
    if not experts:
        raise ValueError(f"config.json names no num_experts: not a {MODEL} checkpoint; use [model] name = qwen3")
    dense = dense_shape_from_hf({**config, "intermediate_size": config.get("intermediate_size") or 0})
    moe = MoEShape(num_experts=experts, top_k=config.get("num_experts_per_tok", 8),
                   hidden_dim=config["moe_intermediate_size"],
                   norm_topk_prob=bool(config.get("norm_topk_prob", False)),
                   dense_layers=dense_layers(config, dense.n_layers))
    return dataclasses.replace(dense, moe=moe)


QWEN3_MOE = ModelFamily("qwen3_moe", ARCHITECTURE, FLAVORS, HF_MODULES, rope_rows, model_types=("qwen3_moe",),
                        shape_from_hf=shape_from_hf)
