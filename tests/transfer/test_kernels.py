"""The one-pass kernels: on a GPU, the engine's copy-out gives the bytes and `bucket_checksum`'s digest
of them, and the trainer's finite check gives the exact NaN/Inf verdict and the same digest, at every
size a bucket can have (whole 8 KiB chunks, a tail of words, a tail of bytes), replayed correctly
with new contents; elsewhere each declines and does nothing."""

from __future__ import annotations

import logging

import pytest
import torch
from dist_helpers import needs_gpus

from titan_lora.transfer.buckets import CHECKSUM_CHUNK_WORDS, bucket_checksum, checksum_words
from titan_lora.transfer import kernels
from titan_lora.transfer.cuda_graphs import capture_count
from titan_lora.transfer.kernels import copy_with_checksum, finite_and_checksum

CHUNK = CHECKSUM_CHUNK_WORDS * 8
SIZES = [8, 5 * 8 + 3, CHUNK, 3 * CHUNK + 5 * 8 + 3, 100 * CHUNK + 17]


def _bytes(n: int, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device)


@pytest.mark.parametrize("n", SIZES)
def test_chunk_sums_taken_elsewhere_give_the_same_digest(n: int) -> None:
    data = _bytes(n, n)
    full = n // CHUNK
    sums = data[: full * CHUNK].view(torch.int64).view(full, CHECKSUM_CHUNK_WORDS).sum(1) if full else None
    assert torch.equal(checksum_words(data, sums), checksum_words(data))
    if full:  # and they are used: other sums give another digest
        assert not torch.equal(checksum_words(data, sums + 1), checksum_words(data))


def test_off_a_gpu_they_decline_and_do_nothing() -> None:
    src, dst = _bytes(CHUNK, 1), torch.zeros(CHUNK, dtype=torch.uint8)
    assert copy_with_checksum(dst, src) is None and not dst.any()
    assert finite_and_checksum(torch.zeros(CHUNK)) is None


def test_a_kernel_that_cannot_build_or_run_turns_the_fused_path_off_with_a_warning(monkeypatch, caplog) -> None:
    def fail(*args: object) -> None:
        raise RuntimeError("no C compiler for Triton's launcher")

    monkeypatch.setattr(kernels, "_broken", False)
    monkeypatch.setattr(kernels._GRAPHS, "read", fail)
    with caplog.at_level(logging.WARNING):
        assert kernels._read(("copy",), torch.device("cpu"), lambda: torch.zeros(2)) is None
    assert "RuntimeError: no C compiler" in caplog.text and "two passes" in caplog.text
    assert kernels._broken and not kernels._fusable(torch.zeros(8))


@needs_gpus(1)
@pytest.mark.parametrize("graphed", [True, False], ids=["recurring", "seen-once"])
@pytest.mark.parametrize("n", SIZES)
def test_on_a_gpu_the_copy_and_its_checksum_come_from_one_pass(n: int, graphed: bool) -> None:
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.zeros(n, dtype=torch.uint8, device="cuda")
    digests = []
    for seed in (1, 2):  # the same buffers again: the second call replays the captured graph (if graphed)
        src.copy_(_bytes(n, seed))
        digests.append(copy_with_checksum(dst, src, graphed=graphed))
        assert torch.equal(dst, src), f"{n} bytes copied wrong (call {seed})"
        assert digests[-1] == bucket_checksum(src), f"{n} bytes: digest differs (call {seed})"
    assert digests[0] != digests[1]


@needs_gpus(1)
def test_on_a_gpu_a_misaligned_or_mismatched_buffer_is_declined() -> None:
    src = _bytes(CHUNK + 8, 3, "cuda")
    dst = torch.zeros(CHUNK + 8, dtype=torch.uint8, device="cuda")
    assert copy_with_checksum(dst[:CHUNK], src[1 : CHUNK + 1]) is None
    assert copy_with_checksum(dst, src[:CHUNK]) is None
    assert not dst.any()


@needs_gpus(1)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [4, 4 * 1024 + 4, 3 * 4096 + 6, 50 * 4096])  # elements: tails, whole chunks
def test_on_a_gpu_the_finite_check_and_the_checksum_come_from_one_read(n: int, dtype: torch.dtype) -> None:
    values = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype).cuda()
    bytes_of = values.view(torch.uint8)
    assert finite_and_checksum(values) == (True, bucket_checksum(bytes_of))
    for where in (0, n // 2, n - 1):  # the first chunk, the middle, the tail
        for bad in (float("nan"), float("inf"), float("-inf")):
            saved = values[where].item()
            values[where] = bad  # the same buffer: the captured graph replays over it
            finite, checksum = finite_and_checksum(values)
            assert not finite, f"{bad} at {where} of {n} went unnoticed"
            assert checksum == bucket_checksum(bytes_of)
            values[where] = saved
    assert finite_and_checksum(values) == (True, bucket_checksum(bytes_of))


@needs_gpus(1)
def test_on_a_gpu_values_whose_sum_overflows_are_still_finite() -> None:
    values = torch.full((3 * 2048,), 3e38, device="cuda")  # float32: any sum of two is inf
    assert finite_and_checksum(values)[0]


def test_a_buffer_seen_once_runs_its_work_directly_and_never_reaches_the_graph_cache(monkeypatch) -> None:
    def capture(*args: object) -> None:
        raise AssertionError("a buffer seen once reached the graph cache")

    monkeypatch.setattr(kernels, "_broken", False)
    monkeypatch.setattr(kernels._GRAPHS, "read", capture)
    assert kernels._read(("copy",), torch.device("cpu"), lambda: torch.tensor([3, 4]), graphed=False) == [3, 4]
    assert not kernels._broken


@needs_gpus(1)
def test_on_a_gpu_only_a_recurring_buffer_is_captured_and_both_ways_agree() -> None:
    n = 3 * CHUNK + 5 * 8 + 3
    src, dst = _bytes(n, 5, "cuda"), torch.zeros(n, dtype=torch.uint8, device="cuda")
    before = capture_count()
    once = copy_with_checksum(dst, src, graphed=False)  # a base bucket: launched, never captured
    assert torch.equal(dst, src) and once == bucket_checksum(src, graphed=False)
    assert capture_count() == before, "a buffer seen once was captured"
    dst.zero_()
    assert copy_with_checksum(dst, src) == once and torch.equal(dst, src)  # an adapter slab: captured
    captured = capture_count()  # at most one (an earlier test may have left a graph for this address)
    assert captured <= before + 1
    for _ in range(2):  # then replayed
        assert copy_with_checksum(dst, src) == once and torch.equal(dst, src)
    assert capture_count() == captured, "a recurring buffer was captured again"
