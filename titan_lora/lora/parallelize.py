"""Parallelize a LoRA model: TP, then activation checkpointing and compile, then FSDP2.

On torchtitan 0.3.0 TP is declared on the model's configs (the adapters' placements with them,
`titan_lora.titan.lora_linear`) and applied by `Module.parallelize`; FSDP is applied here, not by 0.3.0's
`apply_fsdp_to_decoder`, which has no `ignored_params` for `[lora] replicate_adapters`. Activation
checkpointing, compile and the meshes are torchtitan's, through the seam (`titan_lora.titan.parallel`).
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from titan_lora.config import JobConfig
from titan_lora.lora.layer import adapter_params
from titan_lora.lora.replicated import ReplicatedGradSum
from titan_lora.titan.configs import TORCH_DTYPE_MAP
from titan_lora.titan.models import output_head
from titan_lora.titan.parallel import ParallelDims, checkpoint_and_compile, data_parallel_mesh, tensor_parallel

logger = logging.getLogger(__name__)

def lora_parallelize(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    """TP (the configs' shardings, adapters placed to match: `titan.lora_linear.adapter_shardings`), then
    activation checkpointing, compile and FSDP: torchtitan's parallelize for a LoRA model."""
    if parallel_dims.tp_enabled:
        tensor_parallel(model, parallel_dims)
    return _ac_and_fsdp(model, parallel_dims, job_config)


def grads_take_param_placements(model: nn.Module) -> None:
    """For TP adapters outside FSDP, on the materialised model (hooks go with the tensor `to_empty` replaces).

    A replicated adapter's gradient comes out of the backward as a partial sum, and nothing reduces it
    (FSDP2's reduce-scatter does, to the param's placements). Gradient clipping then scaled the partial
    DTensors out of place on NCCL, so the optimizer stepped on unclipped gradients (found by
    tests/trainer/test_train_parity.py under TP=2 on 2 GPUs). Each one is reduced as it is accumulated."""
    for param in model.parameters():
        if param.requires_grad and isinstance(param, DTensor):
            param.register_post_accumulate_grad_hook(_reduce_to_param_placements)


def _reduce_to_param_placements(param: torch.Tensor) -> None:
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(placements=param.placements)


def _ac_and_fsdp(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    # Pipeline and context parallelism have no keys in titan_lora's schema (`run_sections.DROPPED_KEYS`
    # refuses torchtitan's). The order is torchtitan's: AC, compile, FSDP.
    checkpoint_and_compile(model, job_config, parallel_dims)
    if parallel_dims.fsdp_enabled:
        shard_model(model, data_parallel_mesh(parallel_dims), job_config)
    return model


def shard_model(model: nn.Module, mesh: DeviceMesh, job_config: JobConfig) -> None:
    """FSDP2 over `mesh` as torchtitan's `apply_fsdp` applies it, with `[training]`'s mixed precision
    (gloo-safe reductions on CPU). With `[lora] replicate_adapters` the adapters stay out of FSDP, whole
    on every rank (`add_grad_hooks` then sums their gradients)."""
    training, policy = job_config.training, job_config.parallelism.fsdp_reshard_after_forward
    param_dtype = TORCH_DTYPE_MAP[training.mixed_precision_param]
    reduce_dtype = TORCH_DTYPE_MAP[training.mixed_precision_reduce]
    store_frozen_as(model, param_dtype)
    adapters = {p for _, p in adapter_params(model)} if job_config.lora.replicate_adapters else set()
    common = dict(
        mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        offload_policy=CPUOffloadPolicy() if training.enable_cpu_offload else OffloadPolicy(),
        ignored_params=adapters or None,
    )
    reshard = policy != "never"  # "default" reshards: there is no pipeline parallelism
    head = [m for m in (model.norm, output_head(model)) if m is not None]
    tied = _tied_head(model)
    if tied:
        # FSDP needs a tied pair in one group: shard the pair with norm, gathered from first use to last.
        fully_shard([model.tok_embeddings, *head], **common, reshard_after_forward=policy == "always")
    elif model.tok_embeddings is not None:
        fully_shard(model.tok_embeddings, **common, reshard_after_forward=reshard)
    for block in model.layers.values():
        fully_shard(block, **common, reshard_after_forward=reshard)
    if head and not tied:  # used last in forward, first in backward: kept gathered unless "always"
        fully_shard(head, **common, reshard_after_forward=policy == "always")
    fully_shard(model, **common)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # torchtitan divides the loss by the global token count
            if mesh.device_type == "cpu":
                # gloo has no PREMUL_SUM; plain sums with FSDP's own pre/post scaling are equivalent.
                module.set_force_sum_reduction_for_comms(True)


def add_grad_hooks(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> None:
    """The gradient reductions FSDP does not do, hooked on the materialised params (hooks go with the
    tensors `to_empty` replaces): TP's partial sums outside FSDP, and the replicated adapters' sum."""
    data_parallel = parallel_dims.fsdp_enabled or parallel_dims.dp_replicate_enabled
    if data_parallel and not parallel_dims.fsdp_enabled and not job_config.lora.replicate_adapters:
        raise ValueError(
            f"[parallelism] data_parallel_replicate_degree = {parallel_dims.dp_replicate} with "
            "data_parallel_shard_degree = 1 and [lora] replicate_adapters = false: the adapters would be "
            "neither sharded nor summed over the replicas; set replicate_adapters = true (the default)"
        )
    replicated = data_parallel and job_config.lora.replicate_adapters
    if parallel_dims.tp_enabled and (replicated or not parallel_dims.fsdp_enabled):
        grads_take_param_placements(model)
    if replicated:
        mesh = data_parallel_mesh(parallel_dims)
        group = mesh.get_group() if mesh.ndim == 1 else mesh._flatten().get_group()
        reduce_dtype = TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce]
        params = [p for _, p in adapter_params(model)]
        summer = ReplicatedGradSum(params, group, reduce_dtype)
        held = summer.flat.numel() * params[0].element_size() * 2 + summer.flat.nbytes  # params and grads
        logger.info("adapters replicated over %d data-parallel ranks, outside FSDP: %.2f GiB a rank for "
                    "them, their gradients and the reduce buffer, plus their optimizer state ([lora] "
                    "replicate_adapters = false shards them with the base)", mesh.size(), held / 2**30)


def store_frozen_as(model: nn.Module, dtype: torch.dtype) -> None:
    """Keep each frozen floating-point param wider than `dtype` (FSDP's compute dtype) in `dtype`.

    A frozen weight needs no fp32 master copy, and FSDP's all-gather casts it to `dtype` anyway, so the
    unsharded weights, the forward and the gradients are bit-identical while the frozen base's shards
    take half the memory (8 GB a rank for an 8B base on 2 GPUs) and the all-gather copies read half the
    bytes. Tied params stay one param."""
    cast: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.requires_grad or not param.is_floating_point():
                continue
            if param.dtype.itemsize <= dtype.itemsize:
                continue
            if id(param) not in cast:
                cast[id(param)] = nn.Parameter(param.detach().to(dtype), requires_grad=False)
            module._parameters[name] = cast[id(param)]


def _tied_head(model: nn.Module) -> bool:
    output, embedding = output_head(model), getattr(model, "tok_embeddings", None)
    return output is not None and embedding is not None and output.weight is embedding.weight
