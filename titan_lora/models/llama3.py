"""The Llama 3 family: torchtitan's Llama3 with LoRA-aware parallelization, its HF names and RoPE rows.

torchtitan's every Llama 3 flavor (8B, 70B, ...) is `[model] name = "llama3_lora"`; other Llama 3
checkpoints are this family with their own flavors and assets (`titan_lora.models.smollm2`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.models.llama3 import TransformerModelArgs, llama3_args
from torchtitan.models.llama3 import get_train_spec as llama3_train_spec
from torchtitan.models.llama3.infra.parallelize import apply_tp
from torchtitan.models.llama3.model.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.protocols.train_spec import TrainSpec

from titan_lora.export.peft import RopeRows, hf_module_names
from titan_lora.lora.parallelize import lora_parallelize
from titan_lora.models.family import ModelFamily

# One source for the names: torchtitan's own state-dict adapter, which loads and exports the base.
HF_MODULES = hf_module_names(Llama3StateDictAdapter(TransformerModelArgs(), None).from_hf_map)


def rope_rows(args: TransformerModelArgs) -> dict[str, RopeRows]:
    """wq, wk: torchtitan's Llama keeps their rows interleaved, HF rotate-half; head_dim = dim / n_heads."""
    head_dim = args.dim // args.n_heads
    return {"layers.{}.attention.wq": RopeRows(args.n_heads, head_dim),
            "layers.{}.attention.wk": RopeRows(args.n_kv_heads or args.n_heads, head_dim)}


def tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, job_config) -> None:  # noqa: ANN001
    """torchtitan's Llama 3 TP plan (no float8 TP: the LoRA linears are not float8)."""
    apply_tp(model, tp_mesh, loss_parallel=not job_config.parallelism.disable_loss_parallel,
             enable_float8_tensorwise_tp=False)


def lora_train_spec(flavors: Mapping[str, TransformerModelArgs]) -> TrainSpec:
    """torchtitan's Llama3 TrainSpec with `flavors` and LoRA-aware parallelization."""
    base = llama3_train_spec()
    return TrainSpec(
        model_cls=base.model_cls,
        model_args=dict(flavors),
        parallelize_fn=lora_parallelize(tensor_parallel),
        pipelining_fn=None,
        build_optimizers_fn=base.build_optimizers_fn,
        build_lr_schedulers_fn=base.build_lr_schedulers_fn,
        build_dataloader_fn=base.build_dataloader_fn,
        build_tokenizer_fn=base.build_tokenizer_fn,
        build_loss_fn=base.build_loss_fn,
        state_dict_adapter=base.state_dict_adapter,
    )


def llama3_family(
    name: str,
    flavors: Mapping[str, TransformerModelArgs],
    default_assets: Callable[[bool], Path] | None = None,
) -> ModelFamily:
    """A Llama 3 family under `name`: these flavors, Llama's names and RoPE rows, and its HF assets."""
    return ModelFamily(name, lora_train_spec(flavors), HF_MODULES, rope_rows, default_assets)


# torchtitan's own Llama 3 shapes with LoRA-aware parallelization (random init unless hf_assets_path).
LLAMA3 = llama3_family("llama3_lora", llama3_args)
