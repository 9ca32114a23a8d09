"""What an objective may use of the engine: a rollout client, the published versions (read-only), and
a collective call that recovers the engine. Never the syncer itself."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

from titan_lora.clients.rollout import RolloutClient
from titan_lora.sync.versions import ServedVersions

T = TypeVar("T")
EngineCall = Callable[[Callable[[], Any], str], Any]
"""Collective: rank 0 runs the function against the engine, a dead or hung engine is brought back
(base, newest adapter) and the function retried; returns its value on rank 0, None elsewhere."""


@dataclasses.dataclass(frozen=True)
class EngineRollouts:
    """The engine as an objective sees it."""

    client: RolloutClient | None
    """Rank 0 only (None on the other ranks)."""
    versions: ServedVersions
    call: EngineCall
    families: tuple[ServedVersions, ...] = ()
    """With several adapters, each one's versions in adapter order (`versions` is the first's)."""

    def of_adapter(self, k: int) -> EngineRollouts:
        """The engine as adapter `k`'s objective sees it: its own family of versions."""
        return dataclasses.replace(self, versions=self.families[k])
