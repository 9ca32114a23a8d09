"""What a bucket transport is, and the lazy registry that finds one (vLLM's `weight_transfer` style).

A transport is a pair in one file: a trainer-side `BucketBuffer` subclass (allocates bytes an engine
process can reach and describes them once, as JSON: no pickle crosses) and an engine-side opener that
refuses rather than guesses: an `Opener` maps the buffer once and the engine copies each bucket out of
the mapping (shm, cuda_ipc), a `Fetcher` copies each bucket's bytes anew from wherever they live (tcp,
nccl), so that no copy of an earlier bucket is ever served again. The descriptor's "kind" names the pair.
The engine parses a descriptor once (`BucketDesc.parse`: its transport found by kind) and puts the bucket
into its slab with one call (`BucketDesc.receive_into`), whichever side of the pair it is. Built-ins
are `module:ATTRIBUTE` strings imported on first use; the engine resolves registered kinds only, so a
descriptor never makes it import a module of the sender's choosing.

This module imports no transport, and stays importable by the engine process (it imports only
`titan_lora.transfer`), which is why it holds its own registry rather than `titan_lora.registry`.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import contextlib
from typing import Any, ClassVar, Protocol

import torch

from titan_lora.transfer.host_copy import copy_flat
from titan_lora.transfer.host_passes import host_copy_with_checksum
from titan_lora.transfer.kernels import copy_with_checksum


class EngineBuffers(Protocol):
    """What the engine side of a transport needs of the engine (`transfer.transport.BufferCache`)."""

    def mapped(self, bucket: BucketDesc, nbytes: int) -> torch.Tensor:
        """The `nbytes` bytes of `bucket` in its buffer's cached mapping."""

    def lease(self, nbytes: int, device: torch.device) -> contextlib.AbstractContextManager[torch.Tensor]:
        """A slab of `nbytes` uint8 bytes on `device`, the caller's until the block ends."""

BUILT_IN_TRANSPORTS = {
    "shm": "titan_lora.transfer.transports.shm:SHM",
    "cuda_ipc": "titan_lora.transfer.transports.cuda_ipc:CUDA_IPC",
    "tcp": "titan_lora.transfer.transports.tcp:TCP",
    "nccl": "titan_lora.transfer.transports.nccl:NCCL",
}
DEVICE_DEFAULTS = {"cpu": "shm", "cuda": "cuda_ipc"}
"""The transport a trainer's buffers use, by device type."""


class BucketBuffer(abc.ABC):
    """A trainer-owned byte buffer that an engine process can map.

    `BucketBuffer(size, device)` makes one of the device's default transport (`default_transport`); a
    transport subclasses it with its `kind`, `_allocate` and `_fields`.
    """

    kind: ClassVar[str]
    """The descriptor's "kind": the name its transport is registered under."""
    network: ClassVar[bool] = False
    """True: the trainer serves the bytes over the network, and the constructor takes the keyword options
    `host` and `port` (where to serve, as the engine reaches it)."""

    def __new__(cls, size: int, device: torch.device, **options: object) -> BucketBuffer:
        if cls is BucketBuffer:
            cls = default_transport(device).buffer
        return super().__new__(cls)

    def __init__(self, size: int, device: torch.device) -> None:
        self.size = size
        self.device = device
        self.tensor = self._allocate()
        # Once: every CUDA share takes a new slot in torch's IPC ref-counter files (cuda.shm.*) that the
        # producer keeps until the receiver lets go; sharing again on every post (~15k posts) ended in
        # a segfault at exit and left cuda.shm.* files behind.
        self._desc = self._describe()

    @abc.abstractmethod
    def _allocate(self) -> torch.Tensor:
        """`self.size` bytes (uint8) on `self.device`, in memory the engine side can map."""

    @abc.abstractmethod
    def _fields(self) -> dict:
        """What the engine side needs to map this buffer, as JSON values."""

    def _describe(self) -> dict:
        return {"kind": self.kind, **self._fields()}

    def describe(self, offset: int = 0) -> dict:
        """The JSON descriptor the engine opens the buffer with; the bucket starts `offset` bytes in."""
        return {**self._desc, "offset": offset}

    def synchronize(self) -> None:
        """Make packed bytes visible to the other process: wait for the packing kernels of a CUDA buffer,
        which the engine (or the tcp server thread) reads on its own stream; host memory needs nothing."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def unlink(self) -> None:
        """Remove the name engines open this buffer by; mappings already made stay valid."""

    def close(self) -> None:
        """Release the buffer and its name."""
        del self.tensor
        self.unlink()


class Opener(abc.ABC):
    """The engine side of a transport whose buffers it maps once (cached by the engine's `BufferCache`)."""

    @abc.abstractmethod
    def open(self, desc: dict) -> torch.Tensor:
        """The whole uint8 buffer `desc` names (the caller applies the bucket offset). A buffer that
        cannot be mapped as described raises: the engine must never read other bytes and ack them."""

    def exists(self, desc: dict) -> bool:
        """False once the buffer is gone for good, so that its mapping can be released; a transport that
        cannot tell says True and its mappings go by the cache's LRU bound alone."""
        return True

    def device(self, desc: dict) -> torch.device:
        """Where the mapped bytes of `desc`'s buffer lie (the host; a GPU transport says which GPU)."""
        return torch.device("cpu")

    def check(self, bucket: BucketDesc, nbytes: int, buffers: EngineBuffers) -> bool:
        """Map (and so check) the bucket's buffer before its slab is taken; True: it was checked."""
        buffers.mapped(bucket, nbytes)
        return True

    def receive(self, bucket: BucketDesc, into: torch.Tensor, buffers: EngineBuffers,
                graphed: bool) -> str | None:
        """Copy the bucket out of its cached mapping into `into`; the checksum where the copy took it."""
        return _copy_out(into, buffers.mapped(bucket, into.numel()), graphed)


class Fetcher(abc.ABC):
    """The engine side of a transport whose buffers cannot be mapped (another host): it copies the bytes
    of each bucket anew, and the engine caches nothing of them."""

    def device(self, desc: dict) -> torch.device:
        """Where the bytes of `desc`'s buffer arrive: the engine's slab for them should lie there."""
        return torch.device("cpu")

    @abc.abstractmethod
    def fetch(self, desc: dict, offset: int, into: torch.Tensor) -> None:
        """Fill `into` (uint8, on `device(desc)`) with the buffer's bytes [offset, offset + into.numel()). Anything
        short of all of them raises: the engine must never ack bytes it did not receive."""

    def check(self, bucket: BucketDesc, nbytes: int, buffers: EngineBuffers) -> bool:
        """False: a fetched bucket is checked by its fetch (token, range), in `receive`."""
        return False

    def open(self, desc: dict) -> torch.Tensor:
        """Refused: these buffers are fetched per bucket (`receive`), never mapped."""
        raise ValueError(f"{desc.get('kind')} buffers cannot be mapped, only fetched per bucket")

    def receive(self, bucket: BucketDesc, into: torch.Tensor, buffers: EngineBuffers,
                graphed: bool) -> str | None:
        """Fetch the bucket straight into `into` when it is contiguous on `device`, else into a slab
        `buffers` lends there, then copy it out; the checksum where that copy took it."""
        device = self.device(bucket.fields)
        if into.device == device and into.is_contiguous():
            self.fetch(bucket.fields, bucket.offset, into)
            return None
        with buffers.lease(into.numel(), device) as slab:
            self.fetch(bucket.fields, bucket.offset, slab)
            return _copy_out(into, slab, graphed)


def _copy_out(into: torch.Tensor, source: torch.Tensor, graphed: bool) -> str | None:
    """Copy `source` into `into` with its checksum in the same pass (returned) on one GPU or on the host,
    else plainly (None: the caller reads the copy for its checksum)."""
    copied = copy_with_checksum(into, source, graphed=graphed)
    if copied is None:
        copied = host_copy_with_checksum(into, source)
    if copied is None:
        copy_flat(into, source)
    return copied


@dataclasses.dataclass(frozen=True)
class Transport:
    """One transport: its trainer-side buffer class and its engine-side opener (or fetcher)."""

    buffer: type[BucketBuffer]
    opener: Opener | Fetcher

    @property
    def kind(self) -> str:
        """The name descriptors carry and the registry knows it by."""
        return self.buffer.kind


_TRANSPORTS: dict[str, Transport | str] = dict(BUILT_IN_TRANSPORTS)


def register_transport(transport: Transport, default_for: str | None = None) -> Transport:
    """Add a plug-in transport under its kind, once, and make it the trainer's transport for buffers on
    device type `default_for` if given. Register it in the trainer and in the engine process (a module
    the engine imports): each side resolves the kind in its own registry."""
    if transport.kind in _TRANSPORTS:
        raise ValueError(f"bucket transport {transport.kind!r} is already registered")
    _TRANSPORTS[transport.kind] = transport
    if default_for is not None:
        DEVICE_DEFAULTS[default_for] = transport.kind
    return transport


def registered_transports() -> list[str]:
    """The kinds this process can open."""
    return sorted(_TRANSPORTS)


def transport_named(kind: object) -> Transport:
    """The transport a descriptor's "kind" names, loaded on first use."""
    found = _TRANSPORTS.get(kind) if isinstance(kind, str) else None
    if found is None:
        raise ValueError(f"unknown bucket transport {kind!r}: this process has "
                         f"{', '.join(registered_transports())} (a plug-in transport must be registered with "
                         "register_transport in the trainer and in the engine process)")
    if isinstance(found, str):
        module, _, attr = found.partition(":")
        found = _TRANSPORTS[kind] = getattr(importlib.import_module(module), attr)
    return found


@dataclasses.dataclass(frozen=True)
class BucketDesc:
    """One bucket's descriptor as the engine reads it: its transport (found once, by the descriptor's
    "kind"), its buffer's fields (the descriptor less the offset: what identifies the buffer) and where
    the bucket starts in that buffer."""

    transport: Transport
    fields: dict[str, Any]
    offset: int

    @classmethod
    def parse(cls, desc: object) -> BucketDesc:
        """The descriptor a trainer sent (a JSON object), checked: a known kind, an offset of 0 or more."""
        if not isinstance(desc, dict):
            raise ValueError(f"a bucket's segment must be a JSON object, got {type(desc).__name__}")
        offset = desc.get("offset", 0)
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ValueError(f"a bucket's segment offset must be a byte count of 0 or more, got {offset!r}")
        transport = transport_named(desc.get("kind"))
        return cls(transport, {k: v for k, v in desc.items() if k != "offset"}, offset)

    def device(self) -> torch.device:
        """Where this bucket's bytes lie (mapped) or arrive (fetched): its slab's natural device."""
        return self.transport.opener.device(self.fields)

    def checked(self, nbytes: int, buffers: EngineBuffers) -> bool:
        """True when the bucket's buffer was checked now, before any slab is taken for it (a mapped one)."""
        return self.transport.opener.check(self, nbytes, buffers)

    def receive_into(self, into: torch.Tensor, buffers: EngineBuffers, graphed: bool = False) -> str | None:
        """Put this bucket's `into.numel()` bytes into `into` (uint8), through `buffers` (the engine's
        mappings and fetch slabs); the checksum of `into` where the copy took it in the same pass.
        `graphed`: the pair of buffers recurs (an adapter's), so a GPU copy replays a CUDA graph."""
        return self.transport.opener.receive(self, into, buffers, graphed)


def default_transport(device: torch.device) -> Transport:
    """The transport of a trainer's buffers on `device` (`DEVICE_DEFAULTS`)."""
    kind = DEVICE_DEFAULTS.get(device.type)
    if kind is None:
        raise ValueError(f"no bucket transport for device type {device.type!r}")
    return transport_named(kind)
