"""torchtitan's Llama 3 as an `Architecture`: shapes to its model args, its flavors as shapes, its HF names and
TP plan.

Part of the seam (`titan_lora.titan`): 0.3.0 turns the args into a config tree (`Llama3Model.Config`), the
flavors into factories, fuses q/k/v by default and declares TP on the configs instead of `apply_tp`.
"""

from __future__ import annotations

import math

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.models.llama3 import TransformerModelArgs, llama3_args
from torchtitan.models.llama3 import get_train_spec as llama3_train_spec
from torchtitan.models.llama3.infra.parallelize import apply_tp
from torchtitan.models.llama3.model.args import RoPEScalingArgs
from torchtitan.models.llama3.model.state_dict_adapter import Llama3StateDictAdapter

from titan_lora.model_shape import DecoderShape, RopeScaling
from titan_lora.titan.models import Architecture

__all__ = ["LLAMA3", "model_args", "shape_of"]

_UNSCALED = 1.0  # torchtitan's Llama scales RoPE unless the factor is 1 (its default is Llama 3.1's 8)


def _ffn_base(dim: int) -> int:
    return int(2 * 4 * dim / 3)


def model_args(shape: DecoderShape) -> TransformerModelArgs:
    """`shape` as torchtitan's Llama args; ValueError for what its Llama cannot build."""
    if shape.head_dim * shape.n_heads != shape.dim:
        raise ValueError(f"torchtitan's Llama derives head_dim = dim / n_heads = {shape.dim // shape.n_heads}, "
                         f"but the shape asks for {shape.head_dim}; this checkpoint needs another family")
    if shape.qk_norm:
        raise ValueError("torchtitan's Llama has no q/k norms; this checkpoint needs another family (qwen3)")
    # torchtitan sizes the FFN as multiple_of * ceil(m * int(8 dim / 3) / multiple_of): with
    # multiple_of = ffn_hidden_dim and m <= 1, that is exactly ffn_hidden_dim.
    base, ffn = _ffn_base(shape.dim), shape.ffn_hidden_dim
    rope = shape.rope_scaling
    return TransformerModelArgs(
        dim=shape.dim, n_layers=shape.n_layers, n_heads=shape.n_heads, n_kv_heads=shape.n_kv_heads,
        vocab_size=shape.vocab_size, multiple_of=ffn, ffn_dim_multiplier=ffn / base if base > ffn else None,
        norm_eps=shape.norm_eps, rope_theta=shape.rope_theta,
        rope_scaling_args=RoPEScalingArgs(scaling_factor=_UNSCALED) if rope is None else RoPEScalingArgs(
            scaling_factor=rope.factor, low_freq_factor=rope.low_freq_factor,
            high_freq_factor=rope.high_freq_factor,
            original_max_position_embeddings=rope.original_max_position_embeddings),
        max_seq_len=shape.max_seq_len, eos_id=shape.eos_id,
    )


def shape_of(args: TransformerModelArgs) -> DecoderShape:
    """torchtitan's Llama args as a shape (its FFN width computed as its FeedForward does)."""
    hidden = _ffn_base(args.dim)
    if args.ffn_dim_multiplier is not None:
        hidden = int(args.ffn_dim_multiplier * hidden)
    scaling = args.rope_scaling_args
    return DecoderShape(
        dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads or args.n_heads,
        head_dim=args.dim // args.n_heads, ffn_hidden_dim=args.multiple_of * math.ceil(hidden / args.multiple_of),
        vocab_size=args.vocab_size, norm_eps=args.norm_eps, rope_theta=args.rope_theta,
        rope_scaling=None if scaling.scaling_factor == _UNSCALED else RopeScaling(
            scaling.scaling_factor, scaling.low_freq_factor, scaling.high_freq_factor,
            scaling.original_max_position_embeddings),
        max_seq_len=args.max_seq_len, eos_id=args.eos_id,
    )


def hf_weight_map() -> dict[str, str | None]:
    """HF weight name -> torchtitan's (`{}` for the layer), from torchtitan's own Llama state-dict adapter."""
    return Llama3StateDictAdapter(TransformerModelArgs(), None).from_hf_map


def tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, job_config) -> None:  # noqa: ANN001
    """torchtitan's Llama 3 TP plan (no float8 TP: the LoRA linears are not float8)."""
    apply_tp(model, tp_mesh, loss_parallel=not job_config.parallelism.disable_loss_parallel,
             enable_float8_tensorwise_tp=False)


LLAMA3 = Architecture(
    "llama3", llama3_train_spec, model_args, tensor_parallel,
    # The flavors with torchtitan's default attention: flex and varlen need masks titan_lora does not pass.
    flavors={name: shape_of(args) for name, args in llama3_args.items() if args.attn_type == "sdpa"},
    hf_weight_map=hf_weight_map,
)
