"""Freed host memory goes back to the system between a step's per-adapter backwards (glibc's malloc_trim)."""

import ctypes
import ctypes.util
import os

import pytest
import torch

from titan_lora.trainer.host_memory import release_freed_host_memory

GLIBC = ctypes.util.find_library("c") is not None and hasattr(ctypes.CDLL(ctypes.util.find_library("c")), "malloc_trim")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not GLIBC or not os.path.exists("/proc/self/statm"), reason="needs glibc on Linux")
def test_freed_activations_held_by_the_heap_go_back_to_the_system() -> None:
    # Like a backward's freed activations: many mid-sized blocks, the last still alive, so the heap's top
    # cannot shrink and glibc keeps the freed pages of the others unless trimmed.
    big = torch.ones(16 * 2**20 // 4)  # a freed mmap'd block raises glibc's mmap threshold to its size (<= 32 MiB)
    del big
    blocks = [torch.ones(2 * 2**20 // 4) for _ in range(150)]  # 300 MiB in 2 MiB blocks, from the heap now
    keep = blocks[-1]
    del blocks
    held = _rss_mib()
    release_freed_host_memory()
    released = held - _rss_mib()
    assert released > 200, f"RSS fell by {released:.0f} MiB of ~298 freed"
    assert float(keep.sum()) == keep.numel()  # the live block is untouched
