"""Engine side of a transfer, shared by the vLLM worker extension and the receiver process.

A bucket request is parsed once at the engine's route (`BucketRequest.parse`: its descriptor to a
`BucketDesc`, its transport found once), then `receive` walks it straight through: a slab, one call to the
bucket's transport that puts the bytes into it (copied once out of a mapped buffer, shm or cuda_ipc; a
fetching transport, tcp or nccl, receives straight into it), staging, the check, the ack. Slabs
are pooled by bucket layout (`SlabPool`): a slab whose adapter was retired is filled again by a later
bucket of the same layout, and its tensor views and byte count were made when it was first allocated,
so a steady-state sync allocates nothing and runs no Python per tensor (an 8B adapter has 448 of them:
making their views and summing their sizes cost milliseconds per bucket). The checksum of the copy is
computed where the copy lies (on GPU: on the device), and reading its two digest words back is the one
host synchronisation of a bucket: it also waits for the copy, so the ack never comes before the bytes.

Staging holds a transfer's tensors between its buckets and its commit, bounded per kind: a new
transfer evicts the oldest uncommitted ones of its kind (at most one base and two adapters wait), so
transfers that never commit cannot pile up. Every bucket is checked against the checksum the trainer
sent, over the bytes the engine holds after its copy-out (on a GPU, taken by the one-pass copy from
the very words it stores, `transfer/kernels.py`; else by reading the copy); a mismatch discards the
whole transfer.

Fault injection, for the chaos tests (read at every bucket):
- `TITAN_LORA_FAULT_BUCKET_PAUSE_S=<seconds>`: the engine sleeps inside the handling of each bucket,
  after its bytes are in the engine's slab (copied out or fetched) and before they are checked and acked.
- `TITAN_LORA_FAULT_MARKER=<path>`: the pause becomes one-shot and armed by the file's absence: the
  engine pauses only while the file does not exist, and creates it (holding its pid) when it enters the pause. A test
  creates the file to disarm the hook, removes it to arm it, and waits for it to reappear to know that
  a kill lands in the middle of a transfer.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time
from collections.abc import Callable

import torch

from titan_lora.transfer.buckets import Entry, bucket_checksum, bucket_size, tensor_views
from titan_lora.transfer.protocol import adapter_set_part
from titan_lora.transfer.transport import BufferCache
from titan_lora.transfer.transports.base import BucketDesc

PAUSE_ENV = "TITAN_LORA_FAULT_BUCKET_PAUSE_S"
MARKER_ENV = "TITAN_LORA_FAULT_MARKER"
KEEP_UNCOMMITTED = {"base": 1, "adapter": 2}  # per kind, the newest transfers that may wait for a commit
GRAPHED_KINDS = frozenset({"adapter"})
"""Transfers whose buckets recur, so that their copy-out and checksum on a GPU replay CUDA graphs: an
adapter's slabs are pooled by layout and filled again every sync. A base bucket comes once per base send
(hundreds of them, each in a slab of its own), and each capture would synchronize the device and empty
the allocator cache: its kernels are launched directly."""
_FORGOTTEN_KEPT = 256  # ids of evicted or discarded transfers remembered, to refuse their late buckets


class ChecksumMismatch(ValueError):
    """The bytes the engine holds are not the bytes the trainer sent."""


def fault_pause() -> None:
    """The chaos tests' hook: touch the marker, then sleep, when the environment asks for it."""
    pause_s = float(os.environ.get(PAUSE_ENV) or 0)
    if pause_s <= 0:
        return
    marker = os.environ.get(MARKER_ENV)
    if marker:
        try:  # exclusive create: of concurrent buckets (and engines), exactly one pauses
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return
        with os.fdopen(fd, "w") as f:  # which process paused: a test with several engines kills its engine
            f.write(str(os.getpid()))
    time.sleep(pause_s)


@dataclasses.dataclass
class Slab:
    """One bucket's bytes in storage the engine owns, with its tensor views and byte count made once."""

    data: torch.Tensor
    views: dict[str, torch.Tensor]
    nbytes: int
    holders: int = 1
    """Adapters whose tensors lie in it (several adapters sent together share slabs): it goes back to its
    pool when the last of them is dropped."""
    parts: dict[int, list[tuple[int, dict[str, torch.Tensor], int]]] = dataclasses.field(default_factory=dict)
    """Per adapter count of a set sent together: (adapter, its views under PEFT names, their bytes) for each
    adapter with tensors here; made at the slab's first such commit (its views never change)."""

    def split(self, count: int) -> list[tuple[int, dict[str, torch.Tensor], int]]:
        """This slab's views by adapter, in a transfer of `count` adapters (`protocol.adapter_set_name`)."""
        if count not in self.parts:
            by_adapter: dict[int, dict[str, torch.Tensor]] = {}
            for name, view in self.views.items():
                k, tensor_name = adapter_set_part(name, count)
                by_adapter.setdefault(k, {})[tensor_name] = view
            self.parts[count] = [(k, views, sum(v.numel() * v.element_size() for v in views.values()))
                                 for k, views in sorted(by_adapter.items())]
        return self.parts[count]


class SlabPool:
    """Free slabs by bucket layout and device (a layout fixes size, views and bytes); at most
    `kept_per_layout` wait for reuse (0: a pool that only allocates). `device` None: the bucket's own."""

    def __init__(self, device: torch.device | None = None, kept_per_layout: int = 2) -> None:
        self.device = device
        self.kept_per_layout = kept_per_layout
        self._free: dict[tuple[str, torch.device], list[Slab]] = {}
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()  # the receiver serves buckets from several threads

    def size(self, layout: str, entries: list[Entry]) -> int:
        """Bytes of a bucket of `layout` (computed once per layout)."""
        size = self._sizes.get(layout)
        if size is None:
            size = self._sizes[layout] = bucket_size(entries)
        return size

    def take(self, layout: str, entries: list[Entry], source: torch.device) -> Slab:
        """A slab for a bucket of `layout` from `source`: a free one, or a new one (views made now)."""
        device = self.device or source
        with self._lock:
            free = self._free.get((layout, device))
            if free:
                return free.pop()
        data = torch.empty(bucket_size(entries), dtype=torch.uint8, device=device)
        return Slab(data, tensor_views(data, entries), sum(e.nbytes for e in entries))

    def give(self, layout: str, slab: Slab) -> None:
        """Take back a slab one holder no longer reads; it is free once none does."""
        with self._lock:
            if slab.holders > 1:
                slab.holders -= 1
                return
            free = self._free.setdefault((layout, slab.data.device), [])
            if len(free) < self.kept_per_layout:
                free.append(slab)

    def give_all(self, staged: Staged) -> None:
        """Take back every slab of a transfer (dropped, replaced or retired)."""
        for layout, slab in staged.held:
            self.give(layout, slab)


@dataclasses.dataclass(frozen=True)
class BucketRequest:
    """One bucket as the engine's route reads it (`protocol.BUCKET`'s body, or the worker RPC's arguments)."""

    transfer_id: str
    kind: str
    layout: str
    checksum: str | None
    source: BucketDesc
    """Where the bucket's bytes are: the trainer's buffer, its transport and the offset in it."""

    @classmethod
    def parse(cls, body: dict) -> BucketRequest:
        """The request in `body` ("transfer_id", "kind", "layout", "checksum", "segment"), checked before
        any byte is read: a kind staging knows, a descriptor of a registered transport."""
        kind = body.get("kind", "adapter")
        if kind not in KEEP_UNCOMMITTED:
            raise ValueError(f"bucket kind must be one of {sorted(KEEP_UNCOMMITTED)}, got {kind!r}")
        return cls(body["transfer_id"], kind, body["layout"], body.get("checksum"),
                   BucketDesc.parse(body.get("segment")))


def receive(buffers: BufferCache, pool: SlabPool, transfers: TransferStore, req: BucketRequest,
            entries: list[Entry]) -> dict:
    """Put the bucket `req` names into a slab of `pool` (its transport copies or fetches it there, once),
    stage it and check it against the trainer's checksum; the return value is the bucket's ack. A bucket
    its transport refuses (a bare segment name, a wrong tcp token, a range past the buffer's end) stages
    nothing and gives its slab back."""
    size = pool.size(req.layout, entries)
    if req.source.checked(size, buffers):  # staged before the slab is taken: the older transfers a new one
        transfers.stage(req.transfer_id, req.kind, buffers.prune)  # evicts give their slabs back for it
    slab = pool.take(req.layout, entries, req.source.device())
    try:
        copied = req.source.receive_into(slab.data[:size], buffers, graphed=req.kind in GRAPHED_KINDS)
        staged = transfers.stage(req.transfer_id, req.kind, buffers.prune)  # the one begun above, if any
        fault_pause()
    except BaseException:
        pool.give(req.layout, slab)
        raise
    return transfers.hold(req.transfer_id, staged, slab, req.checksum, req.layout, copied)


@dataclasses.dataclass
class Staged:
    """A transfer's tensors between its buckets and its commit."""

    kind: str
    tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    nbytes: int = 0
    held: list[tuple[str, Slab]] = dataclasses.field(default_factory=list)  # (layout, slab) it lies in

    def size(self) -> dict[str, int]:
        """What an ack reports of these tensors."""
        return {"tensors": len(self.tensors), "bytes": self.nbytes}


class TransferStore:
    """Staged transfers by id, at most `KEEP_UNCOMMITTED[kind]` of each kind; `on_drop` gets every
    transfer that is evicted or discarded (never a committed one)."""

    def __init__(self, on_drop: Callable[[Staged], None] = lambda staged: None) -> None:
        self._staged: dict[str, Staged] = {}  # insertion order is age
        self._forgotten: collections.deque[str] = collections.deque(maxlen=_FORGOTTEN_KEPT)
        self._on_drop = on_drop
        self._lock = threading.Lock()

    def stage(self, transfer_id: str, kind: str, on_begin: Callable[[], None] = lambda: None) -> Staged:
        """The staging of `transfer_id` (of a `kind` in KEEP_UNCOMMITTED, as `BucketRequest.parse`
        checked); a new one evicts older ones of its kind and calls `on_begin`."""
        with self._lock:
            staged = self._staged.get(transfer_id)
            if staged is not None:
                if staged.kind != kind:
                    raise ValueError(f"transfer {transfer_id!r} is a {staged.kind} transfer, not {kind}")
                return staged
            if transfer_id in self._forgotten:
                raise ValueError(f"transfer {transfer_id!r} was discarded (a newer transfer of its kind "
                                 "began, or a bucket failed its check): send the whole transfer again")
            older = [t for t, s in self._staged.items() if s.kind == kind]
            evicted = [self._forget(t) for t in older[: max(0, len(older) + 1 - KEEP_UNCOMMITTED[kind])]]
            staged = self._staged[transfer_id] = Staged(kind)
        for dropped in evicted:
            self._on_drop(dropped)
        on_begin()
        return staged

    def hold(self, transfer_id: str, staged: Staged, slab: Slab, expected: str | None, layout: str,
             copied: str | None = None) -> dict:
        """Add one copied-out bucket (`slab`, of `layout`) to `staged` after checking its bytes against
        the trainer's checksum (`copied`: theirs as the copy took it, else it is taken now); the return
        value is the bucket's ack."""
        staged.held.append((layout, slab))  # given back by on_drop even when the check below fails
        if expected is None:
            self.discard(transfer_id)
            raise ValueError("a bucket came without the checksum of its bytes: upgrade the trainer's titan_lora")
        # Either read waits for the copy on a device, so the ack never comes before the bytes.
        recurs = staged.kind in GRAPHED_KINDS
        checksum = copied if copied is not None else bucket_checksum(slab.data, graphed=recurs)
        if checksum != expected:
            self.discard(transfer_id)
            raise ChecksumMismatch(f"checksum mismatch in transfer {transfer_id}: the engine holds "
                                   f"{checksum}, the trainer sent {expected}; the transfer was discarded, "
                                   "send it again")
        staged.tensors.update(slab.views)
        staged.nbytes += slab.nbytes
        return {"tensors": len(slab.views), "bytes": slab.nbytes, "checksum": checksum}

    def take_set(self, transfer_id: str, count: int) -> list[Staged]:
        """Remove a transfer of `count` adapters (tensors named `protocol.adapter_set_name`) and return one
        staging per adapter, its tensors under their PEFT names; a slab that holds tensors of several of
        them is shared (`Slab.holders`)."""
        staged = self.take(transfer_id)
        parts = [Staged(staged.kind) for _ in range(count)]
        try:
            for layout, slab in staged.held:
                owners = slab.split(count)
                slab.holders = len(owners)
                for k, views, nbytes in owners:
                    parts[k].tensors.update(views)
                    parts[k].nbytes += nbytes
                    parts[k].held.append((layout, slab))
        except ValueError:
            for layout, slab in staged.held:
                slab.holders = 1
            self._on_drop(staged)
            raise
        return parts

    def take(self, transfer_id: str) -> Staged:
        """Remove and return a transfer to commit it."""
        with self._lock:
            staged = self._staged.pop(transfer_id, None)
        if staged is None:
            raise ValueError(f"transfer {transfer_id!r} has no buckets: send them before the commit")
        return staged

    def discard(self, transfer_id: str) -> None:
        """Drop a transfer (no commit will find it)."""
        with self._lock:
            staged = self._forget(transfer_id) if transfer_id in self._staged else None
        if staged is not None:
            self._on_drop(staged)

    def pending(self) -> dict[str, int]:
        """Uncommitted transfers per kind."""
        with self._lock:
            return dict(collections.Counter(s.kind for s in self._staged.values()))

    def _forget(self, transfer_id: str) -> Staged:
        self._forgotten.append(transfer_id)
        return self._staged.pop(transfer_id)
