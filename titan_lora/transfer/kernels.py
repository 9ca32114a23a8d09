"""One-pass reads of a GPU bucket (Triton kernels): each side's work on the bytes of a sync, fused with
the checksum both sides take of them.

- The engine's copy-out (`copy_with_checksum`): as two passes, a copy and then `bucket_checksum` read
  the bucket twice; here each 8 KiB checksum chunk is copied, and its word sum written from the words
  stored, so the bytes are read once.
- The trainer's finite check (`finite_and_checksum`): the NaN/Inf count and the chunk sums of the
  gathered adapter from one read of it, instead of a float sum and an integer sum each reading it.

`checksum_words` finishes `bucket_checksum`'s digest from the chunk sums, so both digests are
`bucket_checksum`'s. Like the checksum alone, each replays from a CUDA graph per buffer (addresses and
size) where the caller says the buffer recurs (`graphed`), and launches its kernels directly where it is
seen once (a base bucket: capturing costs a device sync and an allocator cache flush). Where Triton is missing or cannot build its kernels, off a GPU, or for a buffer not 8-byte
aligned, each function declines (returns None; a failed copy may have written part of the
destination, which the caller's copy then overwrites) and the caller runs the two passes.
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable

import torch

from titan_lora.transfer.buckets import CHECKSUM_CHUNK_WORDS, checksum_words, format_checksum
from titan_lora.transfer.cuda_graphs import GraphedReads

logger = logging.getLogger(__name__)
CHUNK_BYTES = CHECKSUM_CHUNK_WORDS * 8
_GRAPHS = GraphedReads()


@functools.cache
def _kernels() -> types.SimpleNamespace | None:
    """The Triton kernels (each compiled at its first launch), or None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def copy_chunks(src, dst, sums, WORDS: tl.constexpr):  # noqa: ANN001, ANN202, N803
        chunk = tl.program_id(0)
        offsets = chunk.to(tl.int64) * WORDS + tl.arange(0, WORDS)
        words = tl.load(src + offsets)
        tl.store(dst + offsets, words)
        tl.store(sums + chunk, tl.sum(words, axis=0))  # int64 adds wrap, as torch's sum does

    @triton.jit
    def finite_chunks(words, values, sums, bad, WORDS: tl.constexpr, VALUES: tl.constexpr):  # noqa: ANN001, ANN202, N803
        chunk = tl.program_id(0)
        tl.store(sums + chunk, tl.sum(tl.load(words + chunk.to(tl.int64) * WORDS + tl.arange(0, WORDS)), axis=0))
        # The same 8 KiB again, as floats: a cache hit, not a second read of memory.
        x = tl.load(values + chunk.to(tl.int64) * VALUES + tl.arange(0, VALUES)).to(tl.float32)
        nonfinite = (x != x) | (tl.abs(x) == float("inf"))
        tl.store(bad + chunk, tl.sum(nonfinite.to(tl.int32), axis=0))

    return types.SimpleNamespace(copy_chunks=copy_chunks, finite_chunks=finite_chunks)


def _fusable(*tensors: torch.Tensor) -> bool:
    return all(t.is_cuda and t.numel() and t.data_ptr() % 8 == 0 for t in tensors) \
        and len({t.device for t in tensors}) == 1 and _kernels() is not None and not _broken


_broken = False  # set once a kernel failed to build or run: every later call declines


def _read(key: tuple, device: torch.device, work: Callable[[], torch.Tensor], graphed: bool = True) -> list | None:
    """`work`'s values, from its graph for `key` if `graphed` (else launched directly), or None (and no
    fused kernel again) when it cannot run: Triton compiles at the first launch, where a missing compiler
    or an unwritable cache raises."""
    global _broken
    try:
        return _GRAPHS.read(key, device, work) if graphed else work().tolist()
    except Exception as err:  # noqa: BLE001 (the two-pass path serves; a real device fault shows there)
        _broken = True
        logger.warning("the one-pass GPU kernels cannot run here (%s: %s): buckets are copied, then "
                       "checksummed, in two passes", type(err).__name__, err)
        return None


def copy_with_checksum(dst: torch.Tensor, src: torch.Tensor, *, graphed: bool = True) -> str | None:
    """Copy flat uint8 `src` into `dst` (as long, on one GPU) and return `bucket_checksum(dst)`, in one
    pass; None where the fused kernel cannot run (then copy and checksum in two passes). `graphed`: the
    pair of buffers recurs, so its launches are captured once and replayed."""
    n = src.numel()
    if dst.numel() != n or not _fusable(dst, src):
        return None
    words = _read(("copy", dst.device, dst.data_ptr(), src.data_ptr(), n), dst.device,
                  lambda: _copy_and_words(dst, src), graphed)
    return None if words is None else format_checksum(words[0], words[1], n)


def _copy_and_words(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    full = src.numel() // CHUNK_BYTES
    sums = None
    if full:
        sums = torch.empty(full, dtype=torch.int64, device=dst.device)
        whole = full * CHUNK_BYTES
        _kernels().copy_chunks[(full,)](src[:whole].view(torch.int64), dst[:whole].view(torch.int64), sums,
                                        WORDS=CHECKSUM_CHUNK_WORDS)
    dst[full * CHUNK_BYTES :].copy_(src[full * CHUNK_BYTES :])
    return checksum_words(dst, sums)


def finite_and_checksum(values: torch.Tensor) -> tuple[bool, str] | None:
    """(no NaN or Inf in flat float tensor `values`, `bucket_checksum` of its bytes) from one read of
    it on its GPU; None where the fused kernel cannot run."""
    if not values.is_floating_point() or not _fusable(values):
        return None
    data = values.view(torch.uint8)
    words = _read(("finite", values.device, values.dtype, values.data_ptr(), data.numel()), values.device,
                  lambda: _finite_and_words(values, data))
    return None if words is None else (words[2] == 0, format_checksum(words[0], words[1], data.numel()))


def _finite_and_words(values: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    full = data.numel() // CHUNK_BYTES
    per_chunk = CHUNK_BYTES // values.element_size()
    sums, nonfinite = None, (~torch.isfinite(values[full * per_chunk :])).sum().view(1)
    if full:
        sums = torch.empty(full, dtype=torch.int64, device=values.device)
        bad = torch.empty(full, dtype=torch.int32, device=values.device)
        _kernels().finite_chunks[(full,)](data[: full * CHUNK_BYTES].view(torch.int64), values, sums, bad,
                                          WORDS=CHECKSUM_CHUNK_WORDS, VALUES=per_chunk)
        nonfinite = nonfinite + bad.sum()
    return torch.cat([checksum_words(data, sums), nonfinite.to(torch.int64)])
