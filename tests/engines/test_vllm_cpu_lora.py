"""The grouped CPU LoRA kernels give vLLM's numbers (they replace its per-token weight gather)."""

from __future__ import annotations

import pytest
import torch

from vllm.lora.ops.torch_ops import lora_ops

from titan_lora.engines import vllm_cpu_lora


@pytest.fixture(scope="module")
def originals():
    return {n: getattr(lora_ops, n) for n in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")}


def with_empty_slot(w: torch.Tensor) -> torch.Tensor:
    """`w` and one more slot of zeros after its last: vLLM's ops then give index -1 no adapter."""
    return torch.cat([w, torch.zeros_like(w[:1])])


@pytest.mark.parametrize("indices, rows", [([0, 0, 0, 0, 0], 5), ([0, 2, -1, 2, 1], 5), ([1], 1), ([2], 5),
                                           ([-1, -1, -1], 3), ([-1], 4)])
def test_grouped_kernels_match_vllm_with_no_adapter_for_index_minus_1(originals, indices, rows):
    # Every slot holds an adapter: vLLM's ops would add the last one's to rows of index -1 (the base
    # model's); ours add none, as when the last slot is empty. One index for several rows broadcasts.
    vllm_cpu_lora._ORIGINAL.update(originals)
    g = torch.Generator().manual_seed(0)
    idx = torch.tensor(indices)
    x = torch.randn(rows, 32, generator=g)
    a = torch.randn(3, 1, 8, 32, generator=g)  # [slots, 1, rank, in]
    b = torch.randn(3, 1, 48, 8, generator=g)  # [slots, 1, out, rank]
    want, got = torch.zeros(rows, 8), torch.zeros(rows, 8)
    originals["bgmv_shrink"](x, with_empty_slot(a), want, idx, 0.5)
    vllm_cpu_lora.bgmv_shrink(x, a, got, idx, 0.5)
    torch.testing.assert_close(got, want)
    y = torch.randn(rows, 8, generator=g)
    want, got = torch.ones(rows, 48), torch.ones(rows, 48)
    originals["bgmv_expand"](y, with_empty_slot(b), want, idx, True)
    vllm_cpu_lora.bgmv_expand(y, b, got, idx, True)
    torch.testing.assert_close(got, want)
    want, got = torch.ones(rows, 100), torch.ones(rows, 100)
    originals["bgmv_expand_slice"](y, with_empty_slot(b), want, idx, 20, 48, True)
    vllm_cpu_lora.bgmv_expand_slice(y, b, got, idx, 20, 48, True)
    torch.testing.assert_close(got, want)


def test_mismatched_rows_fall_back_to_vllm(originals):
    vllm_cpu_lora._ORIGINAL.update(originals)
    x = torch.randn(4, 32)
    a = torch.randn(2, 1, 8, 32)
    with pytest.raises(RuntimeError):  # vLLM's own einsum error, not a silent wrong answer
        vllm_cpu_lora.bgmv_shrink(x, a, torch.zeros(4, 8), torch.tensor([0, 1]), 1.0)
