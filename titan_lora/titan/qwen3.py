"""torchtitan's Qwen3: its model args and flavors, train spec, HF names and the TP plan of dense blocks.

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

__all__ = ["Qwen3ModelArgs", "hf_weight_map", "qwen3_args", "qwen3_train_spec", "tensor_parallel"]


def hf_weight_map() -> dict[str, str | None]:
    """HF weight name -> torchtitan's (`{}` for the layer), from torchtitan's own Qwen3 state-dict adapter
    (MoE weights included)."""
    return Qwen3StateDictAdapter(Qwen3ModelArgs(), None).from_hf_map


def tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, job_config) -> None:  # noqa: ANN001
    """torchtitan's Qwen3 TP plan for dense blocks (no float8 TP: the LoRA linears are not float8)."""
    apply_non_moe_tp(model, tp_mesh, loss_parallel=not job_config.parallelism.disable_loss_parallel,
                     enable_float8_tensorwise_tp=False, enable_async_tp=False, cp_enabled=False)
