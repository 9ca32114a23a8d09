"""Parallelize a titan_lora LoRA model on torchtitan 0.3.0 (prototype, branch tt03): FSDP2 and TP through
0.3.0's own `parallelize_llama` / `parallelize_qwen3`, only the adapters trainable.

Flow, as 0.3.0's Trainer (trainer.py:303-508) minus what titan_lora owns (data, loss, optimizer):
ParallelDims + meshes -> `set_spmd_backend` -> `model_config.update_from_config` (fills every
sub-config's `sharding_config`) -> build on meta -> freeze the base -> the family's parallelize_fn (TP via
`Module.parallelize`, then FSDP2 per block + root) -> `to_empty` -> `init_weights` (= `init_states`, by
each config's `param_init`).

`spmd_backend` defaults to "partial_dtensor" here (DTensor on the model-parallel axes only, FSDP on the
"fsdp" mesh): 0.3.0's default "spmd_types" types every param on the full SPMD mesh and needs the trainer's
input annotation (`annotate_input_spmd_types`, trainer.py:769-775); see tests/titan03/test_parallel.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
import torchtitan.distributed.parallel_dims as tt_parallel_dims
from torchtitan.config import TORCH_DTYPE_MAP, CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.models.llama3.model import Llama3Model
from torchtitan.models.llama3.parallelize import parallelize_llama
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.models.qwen3.parallelize import parallelize_qwen3

from titan_lora.lora.layer import adapter_params, freeze_base
from titan_lora.lora.replicated import ReplicatedGradSum


@dataclass
class _ConfigView:
    """What `Decoder.Config.update_from_config` reads from a non-Trainer caller: `.parallelism`
    (models/common/decoder.py:111-135)."""

    parallelism: ParallelismConfig


def make_parallel_dims(
    *, world_size: int, dp_shard: int = -1, tp: int = 1, spmd_backend: str = "partial_dtensor",
    device_type: str = "cpu",
) -> ParallelDims:
    """ParallelDims with its meshes built. On a CPU host 0.3.0's `device_type` is "cuda"
    (tools/utils.py:55: `_get_available_device_type() or "cuda"`), so the mesh device is set here, the
    trick titan_lora's 0.2.2 seam uses too (parallel_dims.py:19 imports it as a module global)."""
    tt_parallel_dims.device_type = device_type
    dims = ParallelDims(
        dp_replicate=1, dp_shard=dp_shard, cp=1, tp=tp, pp=1, ep=1, world_size=world_size,
        spmd_backend=spmd_backend,  # type: ignore[arg-type]
    )
    dims.build_mesh()
    dist_utils.set_spmd_backend(spmd_backend)  # as the Trainer does (trainer.py:319)
    return dims


def parallelize_fn_for(model_config: Any):
    if isinstance(model_config, Llama3Model.Config):
        return parallelize_llama
    if isinstance(model_config, Qwen3Model.Config):
        return parallelize_qwen3
    raise TypeError(f"no parallelize_fn for {type(model_config).__name__}")


def build_parallel_lora_model(
    model_config: Any,
    parallel_dims: ParallelDims,
    *,
    enable_sequence_parallel: bool = False,
    param_dtype: str = "float32",
    device: str = "cpu",
    init: bool = True,
    replicate_adapters: bool = False,
) -> nn.Module:
    """Build the (already LoRA-converted) `model_config` sharded over `parallel_dims`, base frozen.

    `replicate_adapters` (titan_lora's `[lora]` default): the adapters stay out of FSDP, whole on every
    data-parallel rank (TP-placed under TP), their gradients summed in one all-reduce a step. 0.3.0's
    `apply_fsdp_to_decoder` takes no `ignored_params`, so FSDP is then applied here, as its
    distributed/fsdp.py:110-316 does (per block, embeddings, norm + head, root; gradient division off).
    """
    parallelism = ParallelismConfig(
        data_parallel_shard_degree=parallel_dims.dp_shard,
        tensor_parallel_degree=parallel_dims.tp,
        enable_sequence_parallel=enable_sequence_parallel,
        spmd_backend=parallel_dims.spmd_backend,
    )
    training = TrainingConfig(mixed_precision_param=param_dtype)  # type: ignore[arg-type]
    model_config.update_from_config(config=_ConfigView(parallelism=parallelism))
    with torch.device("meta"):
        model = model_config.build()
    model.verify_module_protocol()
    freeze_base(model)  # before fully_shard: FSDP2 reads requires_grad when it wraps the params
    if replicate_adapters:
        if parallel_dims.spmd_backend != "partial_dtensor":
            raise NotImplementedError("replicate_adapters is prototyped for spmd_backend='partial_dtensor' only")
        if parallel_dims.tp_enabled:
            model.parallelize(parallel_dims)  # TP as parallelize_llama / parallelize_qwen3 do it
        shard_base(model, parallel_dims.get_mesh("fsdp"), TORCH_DTYPE_MAP[param_dtype])
    else:
        model = parallelize_fn_for(model_config)(
            model,
            parallel_dims=parallel_dims,
            training=training,
            parallelism=parallelism,
            compile_config=CompileConfig(),
            ac_config=None,
            dump_folder="",
        )
    if device == "cpu":
        for module in model.modules():
            if isinstance(module, FSDPModule):
                # gloo has no PREMUL_SUM (FSDP2's default average); sums with FSDP's own pre/post
                # scaling are equivalent (titan_lora's 0.2.2 shard_model does the same).
                module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device=device)
    if init:
        with torch.no_grad():
            model.init_weights(buffer_device=None)
    if replicate_adapters:
        # Hooks go on the materialised params (to_empty replaced the meta ones).
        if parallel_dims.tp_enabled:
            for _, param in adapter_params(model):
                param.register_post_accumulate_grad_hook(_grad_to_param_placements)
        if parallel_dims.fsdp_enabled:
            group = parallel_dims.get_mesh("fsdp").get_group()
            params = [p for _, p in adapter_params(model)]
            model._adapter_grad_sum = ReplicatedGradSum(params, group, torch.float32)  # type: ignore[attr-defined]
    return model


def shard_base(model: nn.Module, mesh, param_dtype: torch.dtype) -> None:  # noqa: ANN001
    """FSDP2 over `mesh` with the adapters left out (`ignored_params`), grouped as 0.3.0's
    `apply_fsdp_to_decoder`; gradient division off (the loss is divided by the global token count)."""
    adapters = {p for _, p in adapter_params(model)}
    common = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
                  ignored_params=adapters)
    tied = model.enable_weight_tying
    if tied:  # a tied pair must be in one FSDP group
        fully_shard([model.tok_embeddings, model.norm, model.lm_head], **common, reshard_after_forward=False)
    else:
        fully_shard(model.tok_embeddings, **common)
    for block in model.layers.values():
        fully_shard(block, **common)
    if not tied:
        fully_shard([model.norm, model.lm_head], **common, reshard_after_forward=False)
    fully_shard(model, **common)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)


def _grad_to_param_placements(param: torch.Tensor) -> None:
    """A TP adapter outside FSDP: its gradient can come out Partial (e.g. a replicated lora_A); nothing
    else reduces it, so it is redistributed to the param's placements as it is accumulated."""
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(placements=param.placements)
