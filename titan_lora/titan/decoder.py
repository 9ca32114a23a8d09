"""torchtitan 0.3.0's decoders (dense, or with Qwen3-MoE experts: `titan_lora.titan.moe`) as config trees
built from a neutral `DecoderShape`, and back.

Part of the seam (`titan_lora.titan`). 0.3.0 builds a model from a tree of `Module.Config` dataclasses
(`Llama3Model.Config`, `Qwen3Model.Config`); `decoder_config` fills one from a shape with 0.3.0's public
builders (`make_gqa_config`, `make_ffn_config`). Choices that differ from 0.3.0's own flavors (which fuse
q/k/v and use flex attention):
- q/k/v unfused, and split further than 0.3.0's `QKVLinear` (whose one `wkv` config builds both `wk` and
  `wv`, models/common/attention.py:746-758): `SplitQKVLinear` has its own `wk` and `wv` configs, so a
  converter can adapt `wk` without `wv`, as PEFT can. Names stay 0.3.0's (`attention.qkv_linear.wq`), so
  its state-dict adapters load HF checkpoints unchanged.
- inner attention is `ScaledDotProductAttention`, causal by its `is_causal=True` default: it has a backward
  on CPU and takes tokens only (`model(tokens)`), as every titan_lora caller feeds it.
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
from torchtitan.protocols.module import Module

from titan_lora.model_shape import DecoderShape, RopeScaling
from titan_lora.titan.moe import moe_config, moe_shape_of

__all__ = ["SplitQKVLinear", "decoder_config", "rope_config_of", "shape_of_config", "split_qkv",
           "split_all_qkv"]


class SplitQKVLinear(QKVLinear):
    """0.3.0's unfused `QKVLinear` with a config per projection (`wq`, `wk`, `wv`).

    Its config subclasses `QKVLinear.Config`, so 0.3.0's sharding setter (decoder_sharding.py:142-157) takes
    it; that setter fills `wq` and `wkv` only, so `wk`/`wv` take `wkv`'s sharding at build time when they
    have none of their own. `wkv` is a template, never built. Forward is `QKVLinear`'s."""

    @dataclass(kw_only=True, slots=True)
    class Config(QKVLinear.Config):
        wk: Linear.Config
        wv: Linear.Config

    def __init__(self, config: Config) -> None:
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
            " (a fused `wqkv` has one weight for q, k and v)")
    return SplitQKVLinear.Config(head_dim=qkv.head_dim, param_init=qkv.param_init,
                                 sharding_config=qkv.sharding_config, wq=qkv.wq, wkv=qkv.wkv,
                                 wk=dataclasses.replace(qkv.wkv), wv=dataclasses.replace(qkv.wkv))


def split_all_qkv(model_config: Module.Config) -> None:
    """Split every stock `QKVLinear.Config` of the tree in place (wk and wv become separate configs)."""
    for _, qkv, parent, attr in list(model_config.traverse(Module.Config, recurse=True)):
        if type(qkv) is QKVLinear.Config:
            if isinstance(parent, list):
                parent[attr] = split_qkv(qkv)
            else:
                setattr(parent, attr, split_qkv(qkv))


# Base-weight initialisers (used only when no checkpoint is loaded): 0.3.0's own choices, simplified.
_LINEAR_INIT = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
_NORM_INIT = {"weight": nn.init.ones_}
_EMBEDDING_INIT = {"weight": partial(nn.init.normal_, std=1.0)}


def rope_config(shape: DecoderShape, complex_rope: bool) -> Any:
    """Llama (`complex_rope`): interleaved pairs, llama scaling when the shape scales; Qwen3: rotate-half."""
    rope = shape.rope_scaling
    if not complex_rope:
        return CosSinRoPE.Config(dim=shape.head_dim, max_seq_len=shape.max_seq_len, theta=shape.rope_theta)
    extra = {} if rope is None else dict(
        scaling="llama", scaling_factor=float(rope.factor), low_freq_factor=float(rope.low_freq_factor),
        high_freq_factor=float(rope.high_freq_factor),
        original_max_position_embeddings=int(rope.original_max_position_embeddings))
    return ComplexRoPE.Config(dim=shape.head_dim, max_seq_len=shape.max_seq_len, theta=shape.rope_theta, **extra)


def decoder_config(shape: DecoderShape, model_cls: type, block_cls: type, *, complex_rope: bool) -> Decoder.Config:
    """The 0.3.0 model config tree (unbuilt, no sharding yet) of `shape`."""
    def norm(n: int) -> RMSNorm.Config:
        return RMSNorm.Config(normalized_shape=n, eps=shape.norm_eps, param_init=_NORM_INIT)

    layers = []
    for index in range(shape.n_layers):
        attention = make_gqa_config(
            dim=shape.dim, n_heads=shape.n_heads, n_kv_heads=shape.n_kv_heads,
            # None keeps GQAttention's default (dim // n_heads); passed when it differs.
            head_dim=shape.head_dim if shape.head_dim != shape.dim // shape.n_heads else None,
            wqkv_param_init=_LINEAR_INIT, wo_param_init=_LINEAR_INIT,
            inner_attention=ScaledDotProductAttention.Config(), rope=rope_config(shape, complex_rope),
            fuse_qkv=False, qk_norm=norm(shape.head_dim) if shape.qk_norm else None)
        attention.qkv_linear = split_qkv(attention.qkv_linear)
        if shape.is_moe_layer(index):
            ffn = {"moe": moe_config(shape.dim, shape.moe, _LINEAR_INIT, _LINEAR_INIT)}
        else:
            ffn = {"feed_forward": make_ffn_config(dim=shape.dim, hidden_dim=shape.ffn_hidden_dim,
                                                   w1_param_init=_LINEAR_INIT, w2w3_param_init=_LINEAR_INIT)}
        layers.append(block_cls.Config(attention_norm=norm(shape.dim), ffn_norm=norm(shape.dim),
                                       attention=attention, **ffn))
    return model_cls.Config(
        dim=shape.dim, vocab_size=shape.vocab_size, enable_weight_tying=shape.tied,
        tok_embeddings=Embedding.Config(
            num_embeddings=shape.vocab_size, embedding_dim=shape.dim,
            # Tied: the embedding is the head's weight, initialised once as the head's.
            param_init={"weight": skip_param_init} if shape.tied else _EMBEDDING_INIT),
        norm=norm(shape.dim),
        lm_head=Linear.Config(in_features=shape.dim, out_features=shape.vocab_size, param_init=_LINEAR_INIT),
        layers=layers,
    )


def rope_config_of(model_config: Any) -> Any:
    """The first block's RoPE config."""
    return model_config.layers[0].attention.rope


def shape_of_config(config: Any, eos_id: int = 0) -> DecoderShape:  # a Decoder.Config
    """A 0.3.0 decoder config tree (one of torchtitan's flavors) as a shape."""
    block = config.layers[0]
    attention = block.attention
    moe = moe_shape_of(config)
    dense = next((b.feed_forward for b in config.layers if getattr(b, "feed_forward", None) is not None), None)
    n_heads = attention.n_heads
    n_kv_heads = attention.n_kv_heads or n_heads
    head_dim = attention.qkv_linear.head_dim
    rope = rope_config_of(config)
    scaling = None
    if getattr(rope, "scaling", "none") == "llama":
        scaling = RopeScaling(rope.scaling_factor, rope.low_freq_factor, rope.high_freq_factor,
                              rope.original_max_position_embeddings)
    return DecoderShape(
        dim=config.dim, n_layers=len(config.layers), n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
        ffn_hidden_dim=dense.w1.out_features if dense is not None else moe.hidden_dim,
        vocab_size=config.vocab_size, norm_eps=block.attention_norm.eps,
        rope_theta=rope.theta, rope_scaling=scaling, qk_norm=attention.qk_norm is not None,
        tied=config.enable_weight_tying, max_seq_len=rope.max_seq_len, eos_id=eos_id, moe=moe)
