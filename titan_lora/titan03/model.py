"""torchtitan 0.3.0 model config trees for titan_lora's families, built from a framework-neutral shape.

Prototype (branch tt03): imported by nothing else yet. 0.3.0 builds a model from a tree of
`Module.Config` dataclasses (`Llama3Model.Config`, `Qwen3Model.Config`); this module fills one from a
plain shape object with the public builders of `torchtitan.models.common.config_utils`
(`make_gqa_config`, `make_ffn_config`).

Choices that differ from 0.3.0's own flavors (which fuse q/k/v and use flex attention):
- q/k/v unfused, and split further than 0.3.0's `QKVLinear` (whose one `wkv` config builds both `wk`
  and `wv`, attention.py:746-758): `SplitQKVLinear` has its own `wk` and `wv` configs, so a converter
  can target `wk` without `wv`, as PEFT can (`k_proj` without `v_proj`). Module and param names are
  unchanged (`...attention.qkv_linear.wq/wk/wv`).
- inner attention is `ScaledDotProductAttention` (attention.py:385-448), causal through its
  `is_causal=True` default: it has a backward on CPU, flex has none. The model is then fed tokens only
  (`model(tokens)`): no positions, no masks (SDPA refuses masks). Packed documents are not separated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch.nn as nn
from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import BaseQKVLinear, QKVLinear, ScaledDotProductAttention
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.common.param_init import skip_param_init
from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock
from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock

FAMILIES = ("llama3", "qwen3")


@dataclass
class ModelShape:
    """A decoder's shape, in no framework's terms (any object with these attributes will do)."""

    family: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_hidden_dim: int
    vocab_size: int
    norm_eps: float
    rope_theta: float
    rope_scaling: dict | None = None
    qk_norm: bool = False
    tie_embeddings: bool = False
    max_seq_len: int = 2048


class SplitQKVLinear(QKVLinear):
    """0.3.0's unfused `QKVLinear` with a config per projection (`wq`, `wk`, `wv`).

    Its config subclasses `QKVLinear.Config`, so 0.3.0's sharding setter (`set_qkv_linear_sharding`,
    decoder_sharding.py:142-157) accepts it; that setter fills `wq` and `wkv` only, so `wk`/`wv` take
    `wkv`'s sharding at build time when they have none of their own. `wkv` is a template, never built.
    Forward is `QKVLinear`'s (it only reads `self.wq/wk/wv`, `self.head_dim`).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(QKVLinear.Config):
        wk: Linear.Config
        wv: Linear.Config

    def __init__(self, config: Config):
        BaseQKVLinear.__init__(self, config)
        self.wq = config.wq.build()
        self.wk = _with_template_sharding(config.wk, config.wkv).build()
        self.wv = _with_template_sharding(config.wv, config.wkv).build()


def _with_template_sharding(cfg: Linear.Config, template: Linear.Config) -> Linear.Config:
    if cfg.sharding_config is None and template.sharding_config is not None:
        return dataclasses.replace(cfg, sharding_config=template.sharding_config)
    return cfg


def split_qkv(qkv: Any) -> SplitQKVLinear.Config:
    """A `SplitQKVLinear.Config` from 0.3.0's `QKVLinear.Config` (own copies of `wkv` for wk and wv)."""
    if isinstance(qkv, SplitQKVLinear.Config):
        return qkv
    if type(qkv) is not QKVLinear.Config:
        raise TypeError(
            f"q/k/v must be unfused (QKVLinear.Config) for per-projection adapters, got {type(qkv).__name__}"
            " (a fused `wqkv` has one weight for q, k and v: build with fuse_qkv=False)"
        )
    return SplitQKVLinear.Config(
        head_dim=qkv.head_dim,
        param_init=qkv.param_init,
        sharding_config=qkv.sharding_config,
        wq=qkv.wq,
        wkv=qkv.wkv,
        wk=dataclasses.replace(qkv.wkv),
        wv=dataclasses.replace(qkv.wkv),
    )


# Base-weight initialisers (used only when no checkpoint is loaded): 0.3.0's own choices, simplified.
_LINEAR_INIT = {"weight": partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}
_NORM_INIT = {"weight": nn.init.ones_}
_EMBEDDING_INIT = {"weight": partial(nn.init.normal_, std=0.02)}


def _rope(shape: Any):
    if shape.family == "llama3":
        # ComplexRoPE: interleaved pairs; Llama3StateDictAdapter.from_hf reverse-permutes q/k rows.
        scaling = shape.rope_scaling
        extra = {}
        if scaling:
            extra = dict(
                scaling="llama",
                scaling_factor=float(scaling["factor"]),
                low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            )
        return ComplexRoPE.Config(dim=shape.head_dim, max_seq_len=shape.max_seq_len, theta=shape.rope_theta, **extra)
    if shape.rope_scaling:
        raise NotImplementedError("rope_scaling is not supported for qwen3 in this prototype")
    # CosSinRoPE: HF's rotate-half layout; Qwen3StateDictAdapter does not permute.
    return CosSinRoPE.Config(dim=shape.head_dim, max_seq_len=shape.max_seq_len, theta=shape.rope_theta)


def build_model_config(shape: Any) -> Decoder.Config:
    """The 0.3.0 model config tree (unbuilt, no sharding yet) for `shape`."""
    if shape.family not in FAMILIES:
        raise ValueError(f"family {shape.family!r} is not one of {FAMILIES}")
    model_cls, block_cls = {
        "llama3": (Llama3Model, Llama3TransformerBlock),
        "qwen3": (Qwen3Model, Qwen3TransformerBlock),
    }[shape.family]
    if shape.family == "llama3" and shape.qk_norm:
        raise ValueError("llama3 has no qk_norm")

    def norm(n: int) -> RMSNorm.Config:
        return RMSNorm.Config(normalized_shape=n, eps=shape.norm_eps, param_init=_NORM_INIT)

    layers = []
    for _ in range(shape.n_layers):
        attention = make_gqa_config(
            dim=shape.dim,
            n_heads=shape.n_heads,
            n_kv_heads=shape.n_kv_heads,
            # head_dim=None keeps GQAttention's default scale (and dim // n_heads); pass it when it differs.
            head_dim=shape.head_dim if shape.head_dim != shape.dim // shape.n_heads else None,
            wqkv_param_init=_LINEAR_INIT,
            wo_param_init=_LINEAR_INIT,
            inner_attention=ScaledDotProductAttention.Config(),
            rope=_rope(shape),
            fuse_qkv=False,
            qk_norm=norm(shape.head_dim) if shape.qk_norm else None,
        )
        attention.qkv_linear = split_qkv(attention.qkv_linear)
        layers.append(
            block_cls.Config(
                attention_norm=norm(shape.dim),
                ffn_norm=norm(shape.dim),
                attention=attention,
                feed_forward=make_ffn_config(
                    dim=shape.dim,
                    hidden_dim=shape.ffn_hidden_dim,
                    w1_param_init=_LINEAR_INIT,
                    w2w3_param_init=_LINEAR_INIT,
                ),
            )
        )
    return model_cls.Config(
        dim=shape.dim,
        vocab_size=shape.vocab_size,
        enable_weight_tying=shape.tie_embeddings,
        tok_embeddings=Embedding.Config(
            num_embeddings=shape.vocab_size,
            embedding_dim=shape.dim,
            # Tied: the embedding is the head's weight, initialised once as the head's.
            param_init={"weight": skip_param_init} if shape.tie_embeddings else _EMBEDDING_INIT,
        ),
        norm=norm(shape.dim),
        lm_head=Linear.Config(in_features=shape.dim, out_features=shape.vocab_size, param_init=_LINEAR_INIT),
        layers=layers,
    )


def shape_from_hf(hf_config: Any, family: str, max_seq_len: int = 2048) -> ModelShape:
    """A `ModelShape` from a transformers config (LlamaConfig / Qwen3Config)."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    scaling = getattr(hf_config, "rope_scaling", None)
    rope_params = getattr(hf_config, "rope_parameters", None)  # transformers 5
    theta = getattr(hf_config, "rope_theta", None)
    if rope_params:
        theta = rope_params.get("rope_theta", theta)
        if rope_params.get("rope_type", "default") != "default":
            scaling = rope_params
    if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    return ModelShape(
        family=family,
        dim=hf_config.hidden_size,
        n_layers=hf_config.num_hidden_layers,
        n_heads=hf_config.num_attention_heads,
        n_kv_heads=hf_config.num_key_value_heads,
        head_dim=head_dim,
        ffn_hidden_dim=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size,
        norm_eps=hf_config.rms_norm_eps,
        rope_theta=float(theta),
        rope_scaling=scaling,
        qk_norm=family == "qwen3",
        tie_embeddings=bool(hf_config.tie_word_embeddings),
        max_seq_len=max_seq_len,
    )
