"""A fake titan engine that really reads the trainer's buckets: it maps the shared buffer through the
engine-side `BufferCache`, copies each tensor out slowly (as a busy engine does), checksums its own copy
and acknowledges what it holds. Faults are opt-in, so tests can play a failing or a buggy engine."""

from __future__ import annotations

import dataclasses
import time

import torch

from titan_lora.transfer.buckets import LayoutCache, UnknownLayout, bucket_checksum, bucket_size, tensor_views
from titan_lora.transfer.errors import LayoutUnknownToEngine, TransferError
from titan_lora.transfer.transport import BufferCache


@dataclasses.dataclass
class ReadingEngine:
    """Answers /titan/bucket and /titan/base; `delay_s` is the copy-out time of one bucket."""

    delay_s: float = 0.02
    fail: frozenset[int] = frozenset()  # bucket numbers that fail after their delay
    misread: frozenset[str] = frozenset()  # tensors it reads wrong (zeros, as from a wrong mapping)
    count_error: int = 0  # added to the tensor count of every ack
    checksums: bool = True  # False: an engine that predates checksums
    bodies: list[dict] = dataclasses.field(default_factory=list)
    adapters: dict[str, dict[str, torch.Tensor]] = dataclasses.field(default_factory=dict)
    base: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.buffers, self.layouts = BufferCache(), LayoutCache()
        self.staging: dict[str, dict[str, torch.Tensor]] = {}

    def post(self, route: str, body: dict | None = None, timeout_s: float | None = None) -> dict:
        """One request, as the JSON client sends it."""
        if route == "/titan/bucket":
            return self._bucket(body)
        assert route == "/titan/base", route
        tensors = self.staging.pop(body["transfer_id"])
        self.base = tensors
        return {"version": body["version"], **_size(tensors)}

    def _bucket(self, body: dict) -> dict:
        number = len(self.bodies)
        self.bodies.append(body)
        try:
            entries = self.layouts.resolve(body["layout"], body.get("header"))
        except UnknownLayout as err:
            raise LayoutUnknownToEngine(str(err)) from None
        source = self.buffers.get(body["segment"])
        held = torch.zeros(bucket_size(entries), dtype=torch.uint8)
        for e in entries:  # slowly: a buffer the trainer overwrites now is seen here
            time.sleep(self.delay_s / len(entries))
            if e.name not in self.misread:
                held[e.offset : e.offset + e.nbytes] = source[e.offset : e.offset + e.nbytes]
        if number in self.fail:
            raise TransferError(f"engine said no to bucket {number}")
        tensors = tensor_views(held, entries)
        self.staging.setdefault(body["transfer_id"], {}).update(tensors)
        ack = {"tensors": len(entries) + self.count_error, "bytes": sum(e.nbytes for e in entries)}
        if self.checksums:
            ack["checksum"] = bucket_checksum(held)
        if "commit" in body:
            staged = self.staging.pop(body["transfer_id"])
            self.adapters[body["commit"]["name"]] = staged
            ack["commit"] = {"version": body["commit"]["version"], "apply_ms": 1.0, **_size(staged)}
        return ack


def _size(tensors: dict[str, torch.Tensor]) -> dict:
    return {"tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}
