"""Engine side of a transfer, shared by the vLLM worker extension and the receiver process.

Staging holds a transfer's tensors between its buckets and its commit, bounded per kind: a new
transfer evicts the oldest uncommitted ones of its kind (at most one base and two adapters wait), so
transfers that never commit cannot pile up. Every bucket is checked against the checksum the trainer
sent, over the bytes the engine holds after its copy-out; a mismatch discards the whole transfer.

Fault injection, for the chaos tests (read at every bucket):
- `TITAN_LORA_FAULT_BUCKET_PAUSE_S=<seconds>`: the engine sleeps inside the handling of each bucket,
  after mapping the trainer's buffer and before copying it out.
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
from typing import Any

import torch

from titan_lora.transfer.buckets import bucket_checksum

PAUSE_ENV = "TITAN_LORA_FAULT_BUCKET_PAUSE_S"
MARKER_ENV = "TITAN_LORA_FAULT_MARKER"
KEEP_UNCOMMITTED = {"base": 1, "adapter": 2}  # per kind, the newest transfers that may wait for a commit
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
class Staged:
    """A transfer's tensors between its buckets and its commit."""

    kind: str
    tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    nbytes: int = 0
    held: list[Any] = dataclasses.field(default_factory=list)  # storage to give back when it is dropped

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
        """The staging of `transfer_id`; a new one evicts older ones of its kind and calls `on_begin`."""
        if kind not in KEEP_UNCOMMITTED:
            raise ValueError(f"bucket kind must be one of {sorted(KEEP_UNCOMMITTED)}, got {kind!r}")
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

    def hold(self, transfer_id: str, staged: Staged, held: torch.Tensor, views: dict[str, torch.Tensor],
             expected: str | None, keep: Any = None) -> dict:
        """Add one copied-out bucket (`held`: its bytes, `views`: its tensors) to `staged` after checking
        `held` against the trainer's checksum; the return value is the bucket's ack."""
        if keep is not None:
            staged.held.append(keep)  # given back by on_drop even when the check below fails
        if expected is None:
            self.discard(transfer_id)
            raise ValueError("a bucket came without the checksum of its bytes: upgrade the trainer's titan_lora")
        checksum = bucket_checksum(held)
        if checksum != expected:
            self.discard(transfer_id)
            raise ChecksumMismatch(f"checksum mismatch in transfer {transfer_id}: the engine holds "
                                   f"{checksum}, the trainer sent {expected}; the transfer was discarded, "
                                   "send it again")
        nbytes = sum(t.numel() * t.element_size() for t in views.values())
        staged.tensors.update(views)
        staged.nbytes += nbytes
        return {"tensors": len(views), "bytes": nbytes, "checksum": checksum}

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
