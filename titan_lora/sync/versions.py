"""The one source of truth for which adapter versions an engine holds and which one rollouts use.

A name is published (becomes `active`) only after its load was acknowledged. Rollouts take a lease
on the active name; a version is retired only once it is outside the retention window and has no
lease left, so an unload never waits on an in-flight request (the SGLang unload hang).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Protocol


def versioned_name(lora_name: str, version: int) -> str:
    """The engine-side name of one adapter version: `<lora_name>-v<version>`."""
    return f"{lora_name}-v{version}"


@dataclasses.dataclass(frozen=True)
class Lease:
    """A rollout's hold on one adapter version."""

    name: str
    version: int


class ServedVersions(Protocol):
    """Read-only view of the published versions: what an objective may see of them."""

    @property
    def active(self) -> Lease | None:
        """The newest published version, or None before the first."""
        ...

    @property
    def generation(self) -> int:
        """How many times the engine lost every version (a restart); requests of an older generation are
        past help."""
        ...

    def lease(self) -> contextlib.AbstractContextManager[Lease]:
        """Pin the active version while requests under it run."""
        ...


class AdapterVersions:
    """Live adapter versions of one engine, the active one, and in-flight leases per version.

    Retention keeps `keep_versions` versions: the newest (a training job's samples come from the newest), or
    with `recently_used` the ones last published or held (a service's sampling clients may sample an older
    version for as long as they live, and no client says when it is gone)."""

    def __init__(self, lora_name: str, keep_versions: int, recently_used: bool = False) -> None:
        if keep_versions < 1:
            raise ValueError(f"[weight_sync] keep_versions must be >= 1, got {keep_versions}")
        self.lora_name = lora_name
        self.keep_versions = keep_versions
        self.recently_used = recently_used
        self._last_use: dict[int, int] = {}  # version -> the tick of its publish or its last hold
        self._ticks = 0
        self._live: dict[int, str] = {}  # version -> name, in load order
        self._leases: dict[int, int] = {}
        self._active: int | None = None
        self._generation = 0
        self._cond = threading.Condition()

    @property
    def active(self) -> Lease | None:
        """The newest acknowledged version, or None before the first adapter load."""
        with self._cond:
            return None if self._active is None else Lease(self._live[self._active], self._active)

    @property
    def generation(self) -> int:
        """How many times `forget_all` ran (the engine lost its adapters)."""
        with self._cond:
            return self._generation

    @property
    def live(self) -> list[int]:
        """Versions the engine holds (loaded and not yet retired), oldest first."""
        with self._cond:
            return list(self._live)

    def publish(self, version: int) -> str:
        """Record that `version` was acknowledged by the engine and make it the active one."""
        with self._cond:
            if self._active is not None and version <= self._active:
                raise ValueError(
                    f"adapter version {version} is not newer than the active {self._active}; "
                    "versions are training steps and must grow"
                )
            self._live[version] = versioned_name(self.lora_name, version)
            self._use(version)
            self._active = version
            self._cond.notify_all()
            return self._live[version]

    def forget_all(self) -> None:
        """Drop every record: the engine lost its adapters (restart)."""
        with self._cond:
            self._live.clear()
            self._last_use.clear()
            self._leases.clear()
            self._active = None
            self._generation += 1
            self._cond.notify_all()

    def lease(self) -> contextlib.AbstractContextManager[Lease]:
        """Hold the active version for the duration of one request."""
        with self._cond:
            if self._active is None:
                raise RuntimeError("no adapter version is active yet: sync before the first rollout")
            return self.hold(self._active)

    @contextlib.contextmanager
    def hold(self, version: int) -> Iterator[Lease]:
        """Hold live version `version` (not only the active one) for the duration of one request; KeyError if
        the engine no longer holds it."""
        with self._cond:
            if version not in self._live:
                raise KeyError(f"adapter version {version} of {self.lora_name} is not live (retired, or lost with "
                               "an engine restart)")
            held = Lease(self._live[version], version)
            self._use(version)
            self._leases[held.version] = self._leases.get(held.version, 0) + 1
            generation = self._generation
        try:
            yield held
        finally:
            with self._cond:
                # After forget_all() (engine restart) the count is gone, and a recovery may since have
                # published the same version number again: its leases are not this one's to release.
                if self._generation == generation:
                    left = self._leases.get(held.version, 0) - 1
                    if left > 0:
                        self._leases[held.version] = left
                    else:
                        self._leases.pop(held.version, None)
                self._cond.notify_all()

    def in_flight(self, version: int) -> int:
        """Number of leases held on `version`."""
        with self._cond:
            return self._leases.get(version, 0)

    def _use(self, version: int) -> None:
        self._ticks += 1
        self._last_use[version] = self._ticks

    def expired(self) -> list[Lease]:
        """Versions outside the retention window, oldest (or least recently used) first: the newest (or most
        recently used) `keep_versions` stay, and the active one always."""
        with self._cond:
            versions = [v for v in self._live if v != self._active]
            if self.recently_used:
                versions.sort(key=self._last_use.__getitem__)
            old = versions[: max(0, len(self._live) - self.keep_versions)]
            return [Lease(self._live[v], v) for v in old]

    def wait_drained(self, version: int, timeout_s: float) -> bool:
        """Block until no lease holds `version`; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._leases.get(version, 0) == 0, timeout_s)

    def mark_retired(self, version: int) -> None:
        """Record that the engine unloaded `version`."""
        with self._cond:
            if version == self._active:
                raise ValueError(f"refusing to retire the active adapter version {version}")
            self._live.pop(version, None)
            self._last_use.pop(version, None)
