"""Batched host-memory copies split over two threads.

One thread copies host memory at about half the machine's bandwidth (measured here: 18.6 MB in
4.6 ms on one thread, 2.4 ms on two). Torch releases the GIL inside its ops, so a second Python
thread doubles the rate for the copies on a sync's critical path (the CPU gather's scatter and the
engine's copy-out and slot writes), whatever the process's intra-op thread setting (vLLM's CPU
worker pins it to 1). Device tensors are left to their streams: they take the plain batched call.

The helper copies bytes with numpy, one core, no torch op: a torch op there would start an OpenMP team of the
helper's own (torch's intra-op thread count is one per process), and while that idle team lives libgomp counts
more threads than cores and stops spinning at the barriers of the training thread's team, so every parallel
op of a step sleeps and wakes (measured here: a small-op loop on 2 cores 2.2x slower, 37 k context switches
against 11; the Tinker service's training call 1.5-2.2 s with an engine against 0.9 s).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

# Below this, a hand-off to the helper thread costs more than it saves.
MIN_SPLIT_BYTES = 1 << 20

_helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="titan-host-copy")


def balanced_cut(tensors: Sequence[torch.Tensor]) -> int:
    """The index that splits `tensors` into two runs of about equal bytes (0: do not split)."""
    sizes = list(itertools.accumulate(t.numel() * t.element_size() for t in tensors))
    if not sizes or sizes[-1] < MIN_SPLIT_BYTES or tensors[0].device.type != "cpu":
        return 0
    return min(bisect.bisect_left(sizes, sizes[-1] / 2) + 1, len(tensors) - 1)


def in_two(
    op: Callable[..., object], dsts: list[torch.Tensor], *args: object, cut: int | None = None
) -> None:
    """`op(dsts, *args)` for a `torch._foreach_*_` op, the first `cut` tensors on a helper thread.

    List arguments are split with `dsts`; scalars go to both halves. `cut` defaults to
    `balanced_cut(dsts)`; pass it when the same lists come back every time.
    """
    if not dsts:
        return
    cut = balanced_cut(dsts) if cut is None else cut
    if cut <= 0:
        op(dsts, *args)
        return
    head = [a[:cut] if isinstance(a, list) else a for a in args]
    tail = [a[cut:] if isinstance(a, list) else a for a in args]
    helper_op = _copy_on_one_thread if op is torch._foreach_copy_ else op
    _beside(lambda: helper_op(dsts[:cut], *head), lambda: op(dsts[cut:], *tail))


def on_two_threads(work: Callable[[int, int], None], count: int) -> None:
    """`work(0, count)` as two calls over halves of the range, the first on the helper thread (numpy work:
    see the module's note on torch ops there); done on return."""
    cut = count // 2
    if not cut:
        work(0, count)
        return
    _beside(lambda: work(0, cut), lambda: work(cut, count))


def _beside(on_helper: Callable[[], object], here: Callable[[], object]) -> None:
    """`on_helper()` on the helper thread while `here()` runs on this one; both done on return."""
    pending = _helper.submit(on_helper)
    try:
        here()
    finally:
        pending.result()  # never return while the helper still writes


def _copy_on_one_thread(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """`torch._foreach_copy_(dsts, srcs)` on the calling thread alone: numpy copies the bytes of each pair of
    contiguous host tensors of one dtype and size; any other pair takes torch's copy."""
    for dst, src in zip(dsts, srcs):
        pair = _numpy_pair(dst, src)
        if pair is None:
            dst.copy_(src)
        else:
            np.copyto(*pair)


def numpy_bytes(t: torch.Tensor) -> np.ndarray | None:
    """The bytes of a contiguous host tensor as a numpy array (no copy); None where numpy cannot hold them."""
    if t.device.type != "cpu" or not t.dim() or not t.is_contiguous() or t.is_conj() or t.is_neg():
        return None
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _numpy_pair(dst: torch.Tensor, src: torch.Tensor) -> tuple[np.ndarray, np.ndarray] | None:
    """(dst, src) as numpy arrays where `np.copyto` of them is `dst.copy_(src)`: one dtype, one size, both
    numpy-held; a strided `dst` of `src`'s shape is copied element by element in order (float32 only)."""
    if dst.dtype != src.dtype or dst.numel() != src.numel():
        return None
    if not dst.is_contiguous() and dst.shape == src.shape and dst.dtype == torch.float32 \
            and dst.device.type == src.device.type == "cpu" and src.is_contiguous():
        return dst.detach().numpy(), src.detach().numpy()
    d, s = numpy_bytes(dst), numpy_bytes(src)
    return None if d is None or s is None else (d, s)


def _copy_pairs(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in pairs:
        np.copyto(dst, src)


class HostCopies:
    """`torch._foreach_copy_(dsts, srcs)` over lists that stay the same from call to call (the CPU gather's
    runs): about half the bytes of the pairs numpy can copy go to the helper thread, their numpy views made
    once (making them costs ~10 us a pair: over 1440 pairs, more than the copy saved); the rest stay on the
    calling thread, in one torch call."""

    def __init__(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        pairs = [_numpy_pair(d, s) for d, s in zip(dsts, srcs)]
        movable = [i for i, pair in enumerate(pairs) if pair is not None]
        helper = set(movable[: balanced_cut([dsts[i] for i in movable])])
        self._helper_pairs = [pairs[i] for i in sorted(helper)]
        self._dsts = [d for i, d in enumerate(dsts) if i not in helper]
        self._srcs = [s for i, s in enumerate(srcs) if i not in helper]

    def run(self) -> None:
        """Every copy, done on return."""
        if self._helper_pairs:
            _beside(lambda: _copy_pairs(self._helper_pairs), self._copy_here)
        else:
            self._copy_here()

    def _copy_here(self) -> None:
        if self._dsts:
            torch._foreach_copy_(self._dsts, self._srcs)


def copy_flat(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)` for two flat tensors: host memory half on a helper thread, device memory on the
    caller's stream (a hand-off to the helper cost the engine's copy-out of a GPU bucket ~0.1 ms)."""
    if dst.device.type != "cpu" or src.device.type != "cpu":
        dst.copy_(src)
        return
    dsts, srcs = list(dst.chunk(2)), list(src.chunk(2))
    in_two(torch._foreach_copy_, dsts, srcs, cut=1 if len(dsts) == 2 else 0)
