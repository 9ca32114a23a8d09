"""A rollout that holds a lease on the active version until the test releases it."""

from __future__ import annotations

import threading

from titan_lora.sync.versions import AdapterVersions


def hold_lease(versions: AdapterVersions) -> tuple[threading.Thread, threading.Event]:
    """Start a thread inside `versions.lease()`; returns (thread, release event) once it holds it."""
    entered, release = threading.Event(), threading.Event()

    def rollout() -> None:
        with versions.lease():
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=rollout, daemon=True)
    thread.start()
    assert entered.wait(5), "the rollout thread never took its lease"
    return thread, release
