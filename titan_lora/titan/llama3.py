"""torchtitan's Llama 3: its model args and flavors, train spec, HF names and TP plan.

Part of the seam (`titan_lora.titan`): 0.3.0 turns the args into a config tree (`Llama3Model.Config`), the
flavors into factories, fuses q/k/v by default and declares TP on the configs instead of `apply_tp`.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.models.llama3 import TransformerModelArgs, llama3_args
from torchtitan.models.llama3 import get_train_spec as llama3_train_spec
from torchtitan.models.llama3.infra.parallelize import apply_tp
from torchtitan.models.llama3.model.args import RoPEScalingArgs
from torchtitan.models.llama3.model.state_dict_adapter import Llama3StateDictAdapter

__all__ = ["RoPEScalingArgs", "TransformerModelArgs", "hf_weight_map", "llama3_args", "llama3_train_spec",
           "tensor_parallel"]


def hf_weight_map() -> dict[str, str | None]:
    """HF weight name -> torchtitan's (`{}` for the layer), from torchtitan's own Llama state-dict adapter."""
    return Llama3StateDictAdapter(TransformerModelArgs(), None).from_hf_map


def tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, job_config) -> None:  # noqa: ANN001
    """torchtitan's Llama 3 TP plan (no float8 TP: the LoRA linears are not float8)."""
    apply_tp(model, tp_mesh, loss_parallel=not job_config.parallelism.disable_loss_parallel,
             enable_float8_tensorwise_tp=False)
