"""The emitter protocol: the trainer side of one weight transfer to one engine.

An emitter moves tensors that rank 0 already holds into an inference engine and returns the
engine's acknowledgement. Ordering (base before adapter), versioning and retention are decided by
the syncer (`titan_lora.sync`), not here, so every emitter shares them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from titan_lora.clients.http import ApiKey
from titan_lora.transfer.errors import TransferError
from titan_lora.transfer.protocol import Ack, EngineLimits
from titan_lora.transfer.transport import BucketBuffer, TransportChoice
from titan_lora.transfer.transports.base import DEVICE_DEFAULTS

logger = logging.getLogger(__name__)

# (HF name, tensor) pairs, produced one by one (each may run a collective); a mapping is taken as its items.
BaseTensors = Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]


def base_items(tensors: BaseTensors) -> Iterable[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of `tensors`, lazily."""
    return tensors.items() if isinstance(tensors, Mapping) else tensors


@dataclasses.dataclass(frozen=True)
class AdapterPayload:
    """One adapter version, on rank 0, in PEFT naming (`base_model.model.<hf name>.lora_A.weight`)."""

    name: str
    version: int
    tensors: Mapping[str, torch.Tensor]
    peft_config: Mapping[str, Any]
    home: BucketBuffer | None = None
    """The shared buffer the tensors lie in (the gatherer's output), so they go with no packing copy."""
    finite: bool = True
    """False when a tensor holds NaN or Inf: it must not be sent."""
    known_nbytes: int | None = None
    """The tensors' bytes when the producer knows them (the gatherer does): no sum over 448 tensors per sync."""
    home_checksum: tuple[int, int, str] | None = None
    """(offset, size, `bucket_checksum`) of the bytes in `home` that hold every tensor, read with the
    finite check: a bucket of exactly those bytes is sent with no checksum pass of its own."""

    @property
    def num_tensors(self) -> int:
        """Number of tensors in the adapter."""
        return len(self.tensors)

    @property
    def nbytes(self) -> int:
        """Total bytes of the adapter tensors."""
        if self.known_nbytes is not None:
            return self.known_nbytes
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclasses.dataclass(frozen=True)
class AdapterSet:
    """One version of each of several adapters, gathered together (`sync.adapter_set`): `together` holds every
    part's tensors, named `protocol.adapter_set_name(k, <PEFT name>)`, in one home buffer, so that an emitter
    that can (`SendsAdapterSets`) sends them in one stream with one commit."""

    parts: tuple[AdapterPayload, ...]
    together: AdapterPayload | None
    """None: the parts do not lie together (a subset re-sent after a recovery): they go one after the other."""

    @classmethod
    def of(cls, payload: AdapterPayload | AdapterSet) -> AdapterSet:
        """`payload` as a set (one adapter: itself its only part)."""
        return payload if isinstance(payload, AdapterSet) else cls((payload,), payload)

    @property
    def finite(self) -> bool:
        """False when any part holds NaN or Inf: none is sent."""
        return all(part.finite for part in self.parts)


@runtime_checkable
class SendsAdapterSets(Protocol):
    """An emitter that installs several adapters from one bucket stream (one commit names them all)."""

    def send_adapters(self, adapters: AdapterSet) -> list[Ack]:
        """Install every part under its own name; one ack per part, in order."""
        ...


def send_adapter_set(emitter: Emitter, adapters: AdapterSet) -> list[Ack]:
    """Install every part of `adapters`: in one stream where the emitter can, else one part after the other."""
    if len(adapters.parts) > 1 and adapters.together is not None and isinstance(emitter, SendsAdapterSets):
        return emitter.send_adapters(adapters)
    return [emitter.send_adapter(part) for part in adapters.parts]


def verify_ack(ack: Ack, version: int, tensors: int, nbytes: int, what: str) -> None:
    """Raise unless the engine acknowledged exactly `version`, `tensors` and `nbytes` of `what`."""
    if (ack.version, ack.num_tensors, ack.nbytes) != (version, tensors, nbytes):
        raise TransferError(
            f"the engine acknowledged {what} as version {ack.version}, {ack.num_tensors} tensors, "
            f"{ack.nbytes} bytes; sent version {version}, {tensors} tensors, {nbytes} bytes"
        )


@runtime_checkable
class Emitter(Protocol):
    """Trainer side of a transfer to one engine. Only rank 0 calls it."""

    def engine_limits(self) -> EngineLimits:
        """Query the engine's LoRA limits (rank, slots, targets) for start-up validation."""
        ...

    def engine_incarnation(self) -> str:
        """An id that changes whenever the engine restarts or loses its weights."""
        ...

    def check_live(self, timeout_s: float) -> None:
        """Raise EngineHung unless the part of the engine that does the work (not only its API front)
        answers a no-op within `timeout_s`; EngineUnreachable when nothing answers."""
        ...

    def interrupt(self, reason: str) -> None:
        """End every request in flight on this emitter at once (from another thread: the engine was found
        wedged); each raises EngineHung naming `reason`."""
        ...

    def lend_buffer(self, numel: int, dtype: torch.dtype, device: torch.device,
                    ) -> tuple[torch.Tensor, BucketBuffer | None]:
        """A zeroed tensor for the gather to write the adapter into, and the transport buffer it lies in
        (None: ordinary memory), so that the adapter goes out with no packing copy."""
        ...

    def send_base(self, tensors: BaseTensors, version: int) -> Ack:
        """Install full base weights (HF names) in the engine, consuming `tensors` lazily (at most about
        two buckets held); on failure it may stop early: the caller drains the rest (collectives)."""
        ...

    def send_adapter(self, payload: AdapterPayload) -> Ack:
        """Install an adapter under `payload.name`; the name must not be live yet."""
        ...

    def retire_adapter(self, name: str, timeout_s: float) -> bool:
        """Unload a drained adapter, best effort; False when it did not finish within the timeout."""
        ...

    def close(self) -> None:
        """Release transport resources (shared memory, sessions)."""
        ...


@runtime_checkable
class VerifiesBase(Protocol):
    """An emitter whose engine loads the base itself: the trainer verifies it by digest instead of pushing."""

    def base_digests(self) -> dict[str, Any]:
        """The engine's record of the base it loaded: {"dtype": str | None, "digests": {HF name: digest}}."""
        ...

    def adopt_base(self, version: int) -> None:
        """Have the engine record the base it loaded as ours (the trainer found every digest equal)."""
        ...

    def send_base_part(self, tensors: BaseTensors, version: int) -> Ack:
        """Send only `tensors` (those whose digests differed); the engine reads the rest from its own
        checkpoint and loads the whole base."""
        ...

    def remember_base_digests(self, ours: dict[str, Any], version: int) -> None:
        """The trainer's digests ({"dtype", "digests"}), for engines that come back on their own later (a
        replica's revival verifies its base with them); one engine comes back through the syncer."""
        ...


@runtime_checkable
class HasReplicas(Protocol):
    """An emitter over several engines, some of which may come back on their own and wait for the base."""

    def waiting_for_base(self) -> bool:
        """Whether a revived engine waits for the base from the next sync (rank 0, no request)."""
        ...


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """Where the engine answers, the key it wants and the transport its buckets take: known only once it
    runs (embedded) or is attached. An emitter that sends buckets allocates them of `transport`."""

    url: str
    api_key: ApiKey | str = ""
    """Read per request (`ApiKey.value`): an embedded engine's changes at every start. A str is taken as
    a key that never changes (an attached engine's), and held as an ApiKey."""
    transport: TransportChoice = TransportChoice()

    def __post_init__(self) -> None:
        if isinstance(self.api_key, str):
            object.__setattr__(self, "api_key", ApiKey(self.api_key))


def bucket_route(choice: TransportChoice) -> str:
    """The bucket transport `choice`, in words: its kind and where the trainer serves it, if it does."""
    if choice.kind is None:
        defaults = ", ".join(f"{kind} on {device}" for device, kind in DEVICE_DEFAULTS.items())
        return f"the trainer device's default transport ({defaults})"
    options = dict(choice.options)
    if "host" not in options:
        return choice.kind
    backend = f" (process group backend {options['backend']})" if options.get("backend") else ""
    where = f"{options['host']}:{options['port']}" if options["port"] else f"{options['host']} (a free port)"
    return f"{choice.kind}{backend}, served by the trainer on {where}"


def log_route(url: str, route: str) -> None:
    """Say at start, once per engine, how weights reach the engine at `url`: with an engine on another host
    the route (which transport, which address) is otherwise found only by reading the code."""
    logger.info("engine at %s: weights go %s", url, route)
