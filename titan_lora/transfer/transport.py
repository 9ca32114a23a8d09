"""Bucket buffers seen from both sides: the trainer lends and locates them, the engine caches mappings.

Each transport is a trainer-side and engine-side pair in `transfer/transports/` (POSIX shared memory on
CPU, CUDA IPC on GPU, TCP to any host), found by its descriptor's "kind" (`transports/base.py`). The
trainer owns the buffers; the engine reads a bucket from a JSON descriptor (`BufferCache.bucket`: from
its cached mapping, or fetched anew), copies it out and acknowledges.
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

from titan_lora.transfer.transports.base import BucketBuffer, Fetcher, transport_named
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


def _open(desc: dict) -> torch.Tensor:
    """The whole buffer `desc` names, mapped by the engine side of the transport its "kind" names."""
    opener = transport_named(desc.get("kind")).opener
    if isinstance(opener, Fetcher):
        raise ValueError(f"{desc.get('kind')} buffers cannot be mapped, only fetched per bucket: "
                         "read them with BufferCache.bucket")
    return opener.open(desc)


def _mapping_key(desc: dict) -> str:
    """Every field but the bucket offset: buffers of one CUDA segment share its handle and differ in
    `storage_offset`, so the handle alone would hand out another buffer's bytes."""
    return json.dumps({k: v for k, v in desc.items() if k != "offset"}, sort_keys=True)


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
    """Engine side: open each trainer buffer once and reuse the mapping (at most `max_entries`); the
    buffers of a fetching transport are read anew for every bucket and never cached."""

    def __init__(self, max_entries: int = 32) -> None:
        self.max_entries = max_entries
        self._open: collections.OrderedDict[str, tuple[dict, torch.Tensor]] = collections.OrderedDict()
        self._lock = threading.Lock()  # the engine serves buckets from several threads
        self._slabs = _Slabs()

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

    def fetch_device(self, desc: dict) -> torch.device | None:
        """The device a fetching transport receives the bucket `desc` names on (the host, or the engine's
        GPU for nccl); None for a mapped one."""
        opener = transport_named(desc.get("kind")).opener
        return opener.device(desc) if isinstance(opener, Fetcher) else None

    @contextlib.contextmanager
    def bucket(self, desc: dict, nbytes: int, into: torch.Tensor | None = None) -> Iterator[torch.Tensor]:
        """The `nbytes` bytes of the bucket `desc` names, valid until the block ends (copy them out in
        it): a view of the cached mapping, or bytes fetched from the trainer now, straight into `into`
        when it is contiguous uint8 on `fetch_device(desc)` (the caller's copy-out is then done), else
        into a slab lent for the block."""
        opener = transport_named(desc.get("kind")).opener
        if isinstance(opener, Fetcher):
            if into is not None and into.device == opener.device(desc) and into.is_contiguous():
                opener.fetch(desc, int(desc.get("offset", 0)), into[:nbytes])
                yield into[:nbytes]
                return
            with self._slabs.lease(nbytes, opener.device(desc)) as slab:
                opener.fetch(desc, int(desc.get("offset", 0)), slab)
                yield slab
            return
        view = self.get(desc)[:nbytes]
        if view.numel() < nbytes:
            raise ValueError(f"a bucket of {nbytes} bytes at offset {desc.get('offset', 0)} runs past the end "
                             f"of the {desc.get('kind')} buffer it names")
        yield view

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
