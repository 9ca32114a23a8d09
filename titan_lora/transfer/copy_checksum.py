"""A GPU bucket's copy-out and its checksum in one pass over its bytes.

The engine copies each bucket out of the trainer's buffer and checksums what it holds. As two passes,
that reads the bucket twice and writes it once; a Triton kernel here copies each 8 KiB checksum chunk
and writes the chunk's word sum from the words it stores, so the bytes are read once, and
`checksum_words` finishes `bucket_checksum`'s digest from those sums. Like the checksum alone, the work
replays from a CUDA graph per (destination, source, size). Where Triton is missing, off a GPU, or
for a buffer not 8-byte aligned, `copy_with_checksum` copies nothing and says so: the caller copies,
then checksums.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from titan_lora.transfer.buckets import CHECKSUM_CHUNK_WORDS, checksum_words, format_checksum
from titan_lora.transfer.cuda_graphs import GraphedReads

_GRAPHS = GraphedReads()


@functools.cache
def _kernel() -> Callable | None:
    """The Triton kernel (compiled at its first launch), or None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def copy_chunks(src, dst, sums, CHUNK: tl.constexpr):  # noqa: ANN001, ANN202, N803
        chunk = tl.program_id(0)
        offsets = chunk.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
        words = tl.load(src + offsets)
        tl.store(dst + offsets, words)
        tl.store(sums + chunk, tl.sum(words, axis=0))  # int64 adds wrap, as torch's sum does

    return copy_chunks


def copy_with_checksum(dst: torch.Tensor, src: torch.Tensor) -> str | None:
    """Copy flat uint8 `src` into `dst` (as long, on one GPU) and return `bucket_checksum(dst)`, in one
    pass; None, with nothing copied, where the fused kernel cannot run."""
    n = src.numel()
    if not (src.is_cuda and dst.is_cuda) or n == 0 or dst.numel() != n or src.device != dst.device \
            or src.data_ptr() % 8 or dst.data_ptr() % 8 or _kernel() is None:
        return None
    plain, weighted = _GRAPHS.read((dst.device, dst.data_ptr(), src.data_ptr(), n), dst.device,
                                   lambda: _copy_and_words(dst, src))
    return format_checksum(plain, weighted, n)


def _copy_and_words(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    chunk = CHECKSUM_CHUNK_WORDS * 8
    full = src.numel() // chunk
    sums = None
    if full:
        sums = torch.empty(full, dtype=torch.int64, device=dst.device)
        _kernel()[(full,)](src[: full * chunk].view(torch.int64), dst[: full * chunk].view(torch.int64), sums,
                           CHUNK=CHECKSUM_CHUNK_WORDS)
    dst[full * chunk :].copy_(src[full * chunk :])
    return checksum_words(dst, sums)
