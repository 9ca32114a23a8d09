"""Batched host copies split over two threads: same result as one torch call, split where it pays."""

from __future__ import annotations

import torch

from titan_lora.transfer.host_copy import MIN_SPLIT_BYTES, balanced_cut, copy_flat, in_two


def _tensors(sizes: list[int], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for n in sizes]


def test_in_two_copies_and_scales_every_tensor_like_the_single_call() -> None:
    sizes = [300_000, 5, 200_000, 100_000, 64]  # 2.4 MB: above the split threshold
    srcs, dsts = _tensors(sizes, 0), [torch.zeros(n) for n in sizes]
    cut = balanced_cut(dsts)
    assert 0 < cut < len(dsts), "a large CPU list is split"
    in_two(torch._foreach_copy_, dsts, srcs)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    in_two(torch._foreach_mul_, dsts, 2.5, cut=cut)  # a scalar argument goes to both halves
    assert all(torch.equal(d, s * 2.5) for d, s in zip(dsts, srcs))


def test_small_or_empty_lists_are_not_split() -> None:
    small = [torch.zeros(10), torch.zeros(10)]
    assert balanced_cut(small) == 0 and sum(t.numel() * 4 for t in small) < MIN_SPLIT_BYTES
    assert balanced_cut([]) == 0
    in_two(torch._foreach_copy_, [], [])  # nothing to do, no error
    in_two(torch._foreach_copy_, small, _tensors([10, 10], 1))
    assert small[0].abs().sum() > 0


def test_copy_flat_copies_every_byte_with_an_odd_length() -> None:
    src = torch.randint(0, 255, (3 * MIN_SPLIT_BYTES + 7,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    copy_flat(dst, src)
    assert torch.equal(dst, src)
