"""Giving the host's freed memory back to the system between a step's per-adapter backwards (CPU training).

glibc keeps the pages of freed activations in its heap, and a later forward of another shape does not always
reuse them: with a forward and backward per adapter, each adapter's activations land on new pages and the
process grows by most of one adapter's activations per adapter (docs/multi_adapter.md measures it). Trimming the
heap after each backward returns those pages, so the peak is one adapter's activations, not K of them.
"""

import ctypes
import ctypes.util
import functools
import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is None:
        logger.info("the C library has no malloc_trim: freed host memory stays with the process")
    return trim


def release_freed_host_memory() -> None:
    """Return the heap's free pages to the system (glibc's malloc_trim); a no-op without glibc."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
