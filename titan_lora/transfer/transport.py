"""Bucket buffers seen from both sides: the trainer lends and locates them, the engine caches mappings.

Each transport is a trainer-side and engine-side pair in `transfer/transports/` (POSIX shared memory on
CPU, CUDA IPC on GPU), found by its descriptor's "kind" (`transports/base.py`). The trainer owns the
buffers; the engine opens them from a JSON descriptor, copies a bucket out and acknowledges.
"""

from __future__ import annotations

import atexit
import collections
import json
import threading

import torch

from titan_lora.transfer.transports.base import BucketBuffer, transport_named
from titan_lora.transfer.transports.shm import SHM_DIR

__all__ = ["SHM_DIR", "BucketBuffer", "BufferCache", "lend_buffer", "make_buffers", "offset_in"]


def make_buffers(n: int, size: int, device: torch.device) -> list[BucketBuffer]:
    """`n` buffers of `size` bytes on `device`, of the device's default transport."""
    return [BucketBuffer(size, device) for _ in range(n)]


# Lent buffers live as long as the process (their tensors may outlive any owner); names go at exit.
_LENT: list[BucketBuffer] = []


@atexit.register
def _unlink_lent() -> None:
    """Remove the lent buffers' names at exit (the mappings go with the process)."""
    for buf in _LENT:
        buf.unlink()


def lend_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, BucketBuffer | None]:
    """A zeroed tensor that an engine process can map, and the buffer it lies in, so that what is written
    into it goes to the engine with no packing copy. Where the host has no shared memory to spare: a
    plain tensor and None."""
    size = numel * torch.empty(0, dtype=dtype).element_size()
    try:
        buf = BucketBuffer(size, device)
    except (OSError, ValueError, RuntimeError):
        return torch.zeros(numel, dtype=dtype, device=device), None
    _LENT.append(buf)
    return buf.tensor.zero_().view(dtype), buf


def offset_in(buf: BucketBuffer, tensor: torch.Tensor) -> int | None:
    """The byte offset of `tensor` in `buf`, or None when it lies elsewhere."""
    if tensor.untyped_storage().data_ptr() != buf.tensor.untyped_storage().data_ptr():
        return None
    return tensor.data_ptr() - buf.tensor.data_ptr()


def _open(desc: dict) -> torch.Tensor:
    """The whole buffer `desc` names, mapped by the engine side of the transport its "kind" names."""
    return transport_named(desc.get("kind")).opener.open(desc)


def _mapping_key(desc: dict) -> str:
    """Every field but the bucket offset: buffers of one CUDA segment share its handle and differ in
    `storage_offset`, so the handle alone would hand out another buffer's bytes."""
    return json.dumps({k: v for k, v in desc.items() if k != "offset"}, sort_keys=True)


class BufferCache:
    """Engine side: open each trainer buffer once and reuse the mapping (at most `max_entries`)."""

    def __init__(self, max_entries: int = 32) -> None:
        self.max_entries = max_entries
        self._open: collections.OrderedDict[str, tuple[dict, torch.Tensor]] = collections.OrderedDict()
        self._lock = threading.Lock()  # the engine serves buckets from several threads

    def __len__(self) -> int:
        """Mappings held now."""
        return len(self._open)

    def get(self, desc: dict) -> torch.Tensor:
        """The uint8 tensor behind descriptor `desc`, from its bucket's offset on."""
        key = _mapping_key(desc)
        with self._lock:
            if key in self._open:
                self._open.move_to_end(key)
            else:
                self._open[key] = (desc, _open(desc))
                while len(self._open) > self.max_entries:  # least recently used first; users hold views
                    self._open.popitem(last=False)
            mapped = self._open[key][1]
        return mapped[int(desc.get("offset", 0)) :]

    def clear(self) -> None:
        """Release every mapping. A CUDA mapping's release is what lets the trainer free its IPC
        ref-counter file; an engine that exits still mapping leaves it behind in /dev/shm."""
        with self._lock:
            self._open.clear()

    def prune(self) -> int:
        """Release the mappings of buffers their transport says are gone (a shared-memory segment whose
        trainer freed it or died); returns how many were released. The others (CUDA) go by the LRU bound."""
        with self._lock:
            gone = [key for key, (desc, _) in self._open.items()
                    if not transport_named(desc["kind"]).opener.exists(desc)]
            for key in gone:
                del self._open[key]
        return len(gone)
