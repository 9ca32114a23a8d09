"""torchtitan's Qwen3 (dense) as an `Architecture`: shapes to its model args, its dense flavors as shapes, its
HF names and the TP plan of dense blocks.

Part of the seam (`titan_lora.titan`): 0.3.0 turns the args into a config tree (`Qwen3Model.Config`) and
declares TP on the configs (`set_qwen3_sharding_config`) instead of `apply_non_moe_tp`.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.models.qwen3 import Qwen3ModelArgs, qwen3_args
from torchtitan.models.qwen3 import get_train_spec as qwen3_train_spec
from torchtitan.models.qwen3.infra.parallelize import apply_non_moe_tp
from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

from titan_lora.model_shape import DecoderShape
from titan_lora.titan.models import Architecture

__all__ = ["QWEN3", "model_args", "shape_of"]


def model_args(shape: DecoderShape) -> Qwen3ModelArgs:
    """`shape` as torchtitan's Qwen3 args; ValueError for what its Qwen3 cannot build."""
    if shape.rope_scaling is not None:
        raise ValueError("torchtitan's Qwen3 does not scale RoPE; this checkpoint needs another family")
    return Qwen3ModelArgs(
        dim=shape.dim, n_layers=shape.n_layers, n_heads=shape.n_heads, n_kv_heads=shape.n_kv_heads,
        head_dim=shape.head_dim, hidden_dim=shape.ffn_hidden_dim, vocab_size=shape.vocab_size,
        norm_eps=shape.norm_eps, rope_theta=shape.rope_theta, qk_norm=shape.qk_norm,
        max_seq_len=shape.max_seq_len, eos_id=shape.eos_id, enable_weight_tying=shape.tied,
    )


def shape_of(args: Qwen3ModelArgs) -> DecoderShape:
    """torchtitan's (dense) Qwen3 args as a shape."""
    return DecoderShape(
        dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads or args.n_heads,
        head_dim=args.head_dim, ffn_hidden_dim=args.hidden_dim, vocab_size=args.vocab_size,
        norm_eps=args.norm_eps, rope_theta=args.rope_theta, qk_norm=args.qk_norm, tied=args.enable_weight_tying,
        max_seq_len=args.max_seq_len, eos_id=args.eos_id,
    )


def hf_weight_map() -> dict[str, str | None]:
    """HF weight name -> torchtitan's (`{}` for the layer), from torchtitan's own Qwen3 state-dict adapter
    (MoE weights included)."""
    return Qwen3StateDictAdapter(Qwen3ModelArgs(), None).from_hf_map


def tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, job_config) -> None:  # noqa: ANN001
    """torchtitan's Qwen3 TP plan for dense blocks (no float8 TP: the LoRA linears are not float8)."""
    apply_non_moe_tp(model, tp_mesh, loss_parallel=not job_config.parallelism.disable_loss_parallel,
                     enable_float8_tensorwise_tp=False, enable_async_tp=False, cp_enabled=False)


QWEN3 = Architecture(
    "qwen3", qwen3_train_spec, model_args, tensor_parallel,
    flavors={name: shape_of(args) for name, args in qwen3_args.items() if not args.moe_enabled},
    hf_weight_map=hf_weight_map,
)
