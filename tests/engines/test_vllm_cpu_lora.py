"""The grouped CPU LoRA kernels give vLLM's numbers (they replace its per-token weight gather)."""

from __future__ import annotations

import pytest
import torch

from vllm.lora.ops.torch_ops import lora_ops

from titan_lora.engines import vllm_cpu_lora


@pytest.fixture(scope="module")
def originals():
    return {n: getattr(lora_ops, n) for n in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")}


@pytest.mark.parametrize("indices", [[0, 0, 0, 0, 0], [0, 2, -1, 2, 1], [1]])
def test_grouped_kernels_match_vllm(originals, indices):
    vllm_cpu_lora._ORIGINAL.update(originals)
    g = torch.Generator().manual_seed(0)
    idx = torch.tensor(indices)
    n = len(indices)
    x = torch.randn(n, 32, generator=g)
    a = torch.randn(3, 1, 8, 32, generator=g)  # [slots, 1, rank, in]
    b = torch.randn(3, 1, 48, 8, generator=g)  # [slots, 1, out, rank]
    want, got = torch.zeros(n, 8), torch.zeros(n, 8)
    originals["bgmv_shrink"](x, a, want, idx, 0.5)
    vllm_cpu_lora.bgmv_shrink(x, a, got, idx, 0.5)
    torch.testing.assert_close(got, want)
    y = torch.randn(n, 8, generator=g)
    want, got = torch.ones(n, 48), torch.ones(n, 48)
    originals["bgmv_expand"](y, b, want, idx, True)
    vllm_cpu_lora.bgmv_expand(y, b, got, idx, True)
    torch.testing.assert_close(got, want)
    want, got = torch.ones(n, 100), torch.ones(n, 100)
    originals["bgmv_expand_slice"](y, b, want, idx, 20, 48, True)
    vllm_cpu_lora.bgmv_expand_slice(y, b, got, idx, 20, 48, True)
    torch.testing.assert_close(got, want)


def test_mismatched_rows_fall_back_to_vllm(originals):
    vllm_cpu_lora._ORIGINAL.update(originals)
    x = torch.randn(4, 32)
    a = torch.randn(2, 1, 8, 32)
    with pytest.raises(RuntimeError):  # vLLM's own einsum error, not a silent wrong answer
        vllm_cpu_lora.bgmv_shrink(x, a, torch.zeros(4, 8), torch.tensor([0, 1]), 1.0)
