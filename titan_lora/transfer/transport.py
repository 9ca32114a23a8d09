"""Bucket buffers seen from both sides: the trainer lends and locates them, the engine caches mappings.

Each transport is a trainer-side and engine-side pair in `transfer/transports/` (POSIX shared memory on
CPU, CUDA IPC on GPU, TCP or NCCL to any host), found by its descriptor's "kind" (`transports/base.py`).
The trainer owns the buffers; the engine parses a bucket's JSON descriptor once (`BucketDesc`) and its
transport puts the bucket into the engine's slab, copied out of a mapping this `BufferCache` keeps or
fetched anew into it (through a slab the cache lends where the engine's lies on another device).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import json
import logging
import threading
from collections.abc import Iterator

import torch

from titan_lora.transfer.transports.base import BucketBuffer, BucketDesc, transport_named
from titan_lora.transfer.transports.shm import SHM_DIR

logger = logging.getLogger(__name__)

__all__ = ["SHM_DIR", "BucketBuffer", "BufferCache", "TransportChoice", "lend_buffer", "make_buffers",
           "offset_in", "plain_buffer"]


@dataclasses.dataclass(frozen=True)
class TransportChoice:
    """The transport of a trainer's bucket buffers: `kind` (None: the buffer's device default, shm on
    CPU and cuda_ipc on GPU) and the keyword options its buffer takes (a network transport: host, port)."""

    kind: str | None = None
    options: tuple[tuple[str, object], ...] = ()

    def buffer(self, size: int, device: torch.device) -> BucketBuffer:
        """A buffer of `size` bytes on `device`, of this transport."""
        cls = BucketBuffer if self.kind is None else transport_named(self.kind).buffer
        return cls(size, device, **dict(self.options))


def make_buffers(n: int, size: int, device: torch.device,
                 transport: TransportChoice = TransportChoice()) -> list[BucketBuffer]:
    """`n` buffers of `size` bytes on `device`, of `transport` (default: the device's)."""
    return [transport.buffer(size, device) for _ in range(n)]


# Lent buffers live as long as the process (their tensors may outlive any owner); names go at exit.
_LENT: list[BucketBuffer] = []


@atexit.register
def _unlink_lent() -> None:
    """Remove the lent buffers' names at exit (the mappings go with the process); one that is already
    gone does not keep the others."""
    for buf in _LENT:
        try:
            buf.unlink()
        except OSError as err:
            logger.warning("could not remove lent buffer %s: %s", buf.describe().get("name", buf.kind), err)


def plain_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, None]:
    """A zeroed tensor in ordinary memory and no buffer: what a lender gives when the engine needs none."""
    return torch.zeros(numel, dtype=dtype, device=device), None


def lend_buffer(numel: int, dtype: torch.dtype, device: torch.device,
                transport: TransportChoice = TransportChoice()) -> tuple[torch.Tensor, BucketBuffer | None]:
    """A zeroed tensor that an engine process can reach through `transport`, and the buffer it lies in,
    so that what is written into it goes to the engine with no packing copy. Where the host has no
    shared memory to spare: a plain tensor and None."""
    size = numel * torch.empty(0, dtype=dtype).element_size()
    try:
        buf = transport.buffer(size, device)
    except (OSError, ValueError, RuntimeError) as err:  # the sync still works, with one packing copy
        logger.warning("the gather writes into plain memory, not a %s buffer the engine maps (%s): each sync "
                       "packs the adapter once more", transport.kind or "transport", err)
        return plain_buffer(numel, dtype, device)
    _LENT.append(buf)
    return buf.tensor.zero_().view(dtype), buf


def offset_in(buf: BucketBuffer, tensor: torch.Tensor) -> int | None:
    """The byte offset of `tensor` in `buf`, or None when it lies elsewhere."""
    if tensor.untyped_storage().data_ptr() != buf.tensor.untyped_storage().data_ptr():
        return None
    return tensor.data_ptr() - buf.tensor.data_ptr()


def _mapping_key(bucket: BucketDesc) -> str:
    """Every field but the bucket offset: buffers of one CUDA segment share its handle and differ in
    `storage_offset`, so the handle alone would hand out another buffer's bytes."""
    return json.dumps(bucket.fields, sort_keys=True)


class _Slabs:
    """Reusable slabs that fetched buckets land in, on the device their transport receives on: a fresh
    multi-MB allocation page-faults on every first touch, which costs about as much as the copy. At
    most `kept` wait for reuse."""

    def __init__(self, kept: int = 4) -> None:
        self.kept = kept
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def lease(self, nbytes: int, device: torch.device = torch.device("cpu")) -> Iterator[torch.Tensor]:
        """`nbytes` uint8 bytes on `device`, this caller's alone until the block ends."""
        with self._lock:
            fits = [i for i, s in enumerate(self._free) if s.numel() >= nbytes and s.device == device]
            # By index: list.remove compares tensors with ==, elementwise.
            slab = self._free.pop(min(fits, key=lambda i: self._free[i].numel())) if fits else None
        if slab is None:
            slab = torch.empty(nbytes, dtype=torch.uint8, device=device)
        try:
            yield slab[:nbytes]
        finally:
            with self._lock:
                self._free.append(slab)
                if len(self._free) > self.kept:  # the smallest go first: buckets only grow
                    self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))


class BufferCache:
    """Engine side: open each mapped trainer buffer once and reuse the mapping (at most `max_entries`),
    and lend the slabs a fetching transport receives into where the engine's own lies elsewhere."""

    def __init__(self, max_entries: int = 32) -> None:
        self.max_entries = max_entries
        self._open: collections.OrderedDict[str, tuple[BucketDesc, torch.Tensor]] = collections.OrderedDict()
        self._lock = threading.Lock()  # the engine serves buckets from several threads
        self._slabs = _Slabs()

    def __len__(self) -> int:
        """Mappings held now."""
        return len(self._open)

    def get(self, desc: dict) -> torch.Tensor:
        """The uint8 tensor behind the JSON descriptor `desc` of a mapped buffer, from its offset on."""
        bucket = BucketDesc.parse(desc)
        return self._mapping(bucket)[bucket.offset :]

    def mapped(self, bucket: BucketDesc, nbytes: int) -> torch.Tensor:
        """The `nbytes` bytes of `bucket` in its buffer's cached mapping (mapped now on first use)."""
        view = self._mapping(bucket)[bucket.offset : bucket.offset + nbytes]
        if view.numel() < nbytes:
            raise ValueError(f"a bucket of {nbytes} bytes at offset {bucket.offset} runs past the end "
                             f"of the {bucket.transport.kind} buffer it names")
        return view

    def _mapping(self, bucket: BucketDesc) -> torch.Tensor:
        key = _mapping_key(bucket)
        with self._lock:
            if key in self._open:
                self._open.move_to_end(key)
            else:
                self._open[key] = (bucket, bucket.transport.opener.open(bucket.fields))
                while len(self._open) > self.max_entries:  # least recently used first; users hold views
                    self._open.popitem(last=False)
            return self._open[key][1]

    def lease(self, nbytes: int, device: torch.device) -> contextlib.AbstractContextManager[torch.Tensor]:
        """A slab of `nbytes` uint8 bytes on `device`, the caller's alone until the block ends."""
        return self._slabs.lease(nbytes, device)

    def clear(self) -> None:
        """Release every mapping. A CUDA mapping's release is what lets the trainer free its IPC
        ref-counter file; an engine that exits still mapping leaves it behind in /dev/shm."""
        with self._lock:
            self._open.clear()

    def prune(self) -> int:
        """Release the mappings of buffers their transport says are gone (a shared-memory segment whose
        trainer freed it or died); returns how many were released. The others (CUDA) go by the LRU bound."""
        with self._lock:
            gone = [key for key, (bucket, _) in self._open.items()
                    if not bucket.transport.opener.exists(bucket.fields)]
            for key in gone:
                del self._open[key]
        return len(gone)
