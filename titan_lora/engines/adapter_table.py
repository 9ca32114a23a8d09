"""Which adapter versions the OpenAI server serves, what each bare adapter name aliases, and the
requests in flight on each version.

Versions are named `<lora_name>-v<step>` by the trainer. The bare `<lora_name>` is an alias for the
version committed last (a resumed trainer that sends an older step again moves it back too), resolved
when a request arrives; retiring that version moves the alias to the newest one left. A request holds
a lease on the version it resolved to until it finishes, and a version is removed only while it holds
none. Everything runs on the API server's one event loop: a lookup and its lease, or a drain check and
the removal, happen with no `await` between them, so no request can slip in.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
from collections.abc import AsyncIterator


@dataclasses.dataclass(frozen=True)
class Served:
    """One live adapter version."""

    name: str
    version: int
    lora_id: int
    alias: str | None  # the bare lora_name, when `name` is `<alias>-v<version>`


def alias_of(name: str, version: int) -> str | None:
    """The bare adapter name that versioned `name` belongs to, or None when it is not `<x>-v<version>`."""
    suffix = f"-v{version}"
    return name[: -len(suffix)] if name.endswith(suffix) and len(name) > len(suffix) else None


class AdapterTable:
    """Live versions, aliases and leases of one engine."""

    def __init__(self) -> None:
        self._served: dict[str, Served] = {}  # insertion order is commit order
        self._in_flight: collections.Counter[str] = collections.Counter()
        self._changed = asyncio.Condition()

    def add(self, name: str, version: int, lora_id: int) -> Served:
        """Record a committed version; it becomes what its alias serves."""
        self._served.pop(name, None)  # re-adding moves it to the end: the newest commit
        served = self._served[name] = Served(name, version, lora_id, alias_of(name, version))
        return served

    def get(self, name: str) -> Served | None:
        """The live version called `name`, if any."""
        return self._served.get(name)

    def newest(self, alias: str) -> Served | None:
        """The version `alias` serves now: the last committed of its live versions."""
        return next((s for s in reversed(self._served.values()) if s.alias == alias), None)

    def resolve(self, model: str) -> Served | None:
        """The version a request for `model` runs on: a live versioned name, or an alias's newest."""
        return self._served.get(model) or self.newest(model)

    def not_served(self, model: str) -> str | None:
        """Why `model` is not served, when it looks like a version of one of our adapters."""
        for alias in {s.alias for s in self._served.values() if s.alias}:
            tail = model[len(alias) + 2:] if model.startswith(alias + "-v") else ""
            if tail.isdigit():
                live = ", ".join(s.name for s in self._served.values() if s.alias == alias)
                return (f"adapter version {model!r} is not live on this engine (retired, or never loaded); "
                        f"live versions: {live}; model={alias!r} serves the newest")
        return None

    @contextlib.asynccontextmanager
    async def lease(self, name: str) -> AsyncIterator[None]:
        """Count one request in flight on `name` while the block runs."""
        self._in_flight[name] += 1
        try:
            yield
        finally:
            self._in_flight[name] -= 1
            async with self._changed:
                self._changed.notify_all()

    def in_flight(self) -> dict[str, int]:
        """Requests in flight per version name."""
        return {k: v for k, v in self._in_flight.items() if v}

    async def wait_unused(self, name: str, timeout_s: float) -> bool:
        """Wait until no request holds `name`; False after `timeout_s`."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self._in_flight[name] == 0), timeout_s)
            except TimeoutError:
                return False
        return True

    def remove(self, name: str) -> Served | None:
        """Drop `name` when no request holds it (None: unknown, or still in use; see `in_flight`)."""
        if self._in_flight[name]:
            return None
        return self._served.pop(name, None)

    def names(self) -> dict[str, int]:
        """Live version names and their vLLM int ids."""
        return {s.name: s.lora_id for s in self._served.values()}

    def aliases(self) -> dict[str, str]:
        """Each alias and the version it serves now."""
        return {s.alias: s.name for s in self._served.values() if s.alias}  # later commits win
