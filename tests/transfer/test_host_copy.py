"""Batched host copies split over two threads: same result as one torch call, split where it pays."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_lora.transfer.host_copy import MIN_SPLIT_BYTES, HostCopies, balanced_cut, copy_flat, in_two


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


def test_the_helpers_half_copies_every_dtype_layout_and_view_byte_for_byte() -> None:
    g = torch.Generator().manual_seed(2)
    base = torch.randn(600, 700, generator=g)
    # bf16 and int64 contiguous, a transposed (non-contiguous) source, a param that requires grad, a 0-dim
    srcs = [base.to(torch.bfloat16), torch.randint(-9, 9, (300_000,), generator=g), base.t(),
            torch.nn.Parameter(base[:10].clone()), torch.tensor(3.5), torch.randn(8, generator=g)]
    dsts = [torch.empty_like(s, memory_format=torch.contiguous_format).detach() for s in srcs]
    in_two(torch._foreach_copy_, dsts, srcs, cut=len(dsts) - 1)  # every pair but the last on the helper
    for d, s in zip(dsts, srcs):
        assert d.dtype == s.dtype and torch.equal(d, s.detach())


def test_host_copies_copy_every_pair_byte_for_byte_run_after_run_with_the_numpy_views_made_once() -> None:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(600, 700, generator=g)
    # what numpy can copy (fp32, bf16, int64, a param) and what stays with torch (a transposed source, another
    # dtype, a 0-dim), in a list big enough to split
    srcs = [base.clone(), base.to(torch.bfloat16), torch.randint(-9, 9, (300_000,), generator=g),
            torch.nn.Parameter(base[:10].clone()), base.t(), torch.tensor(3.5), base[:5]]
    dsts = [torch.empty_like(s, memory_format=torch.contiguous_format).detach() for s in srcs]
    dsts[-1] = torch.empty(5, 700, dtype=torch.float64)  # a converting copy: never copied as bytes
    copies = HostCopies(dsts, srcs)
    assert copies._helper_pairs and copies._dsts, "split between the helper and the caller"
    assert len(copies._helper_pairs) + len(copies._dsts) == len(dsts)
    for round_ in range(2):  # the same views, new values
        with torch.no_grad():
            for s in srcs:
                if s.dtype.is_floating_point:
                    s.add_(round_ + 1)
        copies.run()
        for d, s in zip(dsts, srcs):
            assert torch.equal(d, s.detach().to(d.dtype)), (round_, d.dtype, s.shape)


def test_small_host_copies_stay_on_the_calling_thread() -> None:
    srcs, dsts = _tensors([10, 20], 4), [torch.zeros(10), torch.zeros(20)]
    copies = HostCopies(dsts, srcs)
    assert not copies._helper_pairs
    copies.run()
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))


HELPER_THREADS = """
import os, torch
from titan_lora.transfer.host_copy import in_two
def threads(): return len(os.listdir("/proc/self/task"))
src, dst = [torch.randn(4_000_000), torch.randn(4_000_000)], [torch.empty(4_000_000), torch.empty(4_000_000)]
torch.ones(4_000_000).sum()  # this thread's own OpenMP team, before counting
before = threads()
in_two(torch._foreach_copy_, dst, src, cut=1)
assert torch.equal(dst[0], src[0]) and torch.equal(dst[1], src[1])
print(torch.get_num_threads(), threads() - before)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_the_helper_starts_no_openmp_team_of_its_own() -> None:
    """A second OpenMP team in the process makes libgomp stop spinning at every barrier of the training
    thread's team (2.2x slower small ops on 2 cores): the helper adds its own thread and nothing else."""
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", HELPER_THREADS], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    torch_threads, added = map(int, out.stdout.split())
    assert torch_threads == 2
    assert added == 1, f"the helper's copy started {added - 1} thread(s) beside the helper"
