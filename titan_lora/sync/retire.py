"""Retire adapter versions off the training path: drained first, best effort, bounded in time.

An unload can block on the engine side (SGLang waits for in-flight requests, and leaked usage
counters make that wait endless), so it never runs on the trainer's thread and a stuck unload costs
the trainer nothing: it is counted, logged, and tried again at a later schedule once that call has
returned. The engine is asked to drain for half the time we wait for its answer, so an engine that
answers "not drained yet" is heard as such (and retried), not mistaken for a stuck call.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from titan_lora.sync.versions import AdapterVersions, Lease

logger = logging.getLogger(__name__)


class Retirer:
    """A daemon thread that unloads expired versions once their leases have drained."""

    def __init__(
        self,
        versions: AdapterVersions,
        unload: Callable[[str, float], bool],
        timeout_s: float,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"[weight_sync] retire_timeout_s must be > 0 (seconds an unload may take), "
                             f"got {timeout_s}")
        self._versions = versions
        self._unload = unload
        self._timeout_s = timeout_s
        self._queue: queue.Queue[Lease | None] = queue.Queue()
        self._pending: set[int] = set()
        self._lock = threading.Lock()
        self._calls: dict[int, threading.Thread] = {}  # version -> its last unload call
        self.retired = 0
        self.failed = 0
        self._thread = threading.Thread(target=self._run, name="titan-lora-retirer", daemon=True)
        self._thread.start()

    def schedule_expired(self) -> None:
        """Queue every version outside the retention window that is not already queued (stuck and
        failed ones again: they are still live)."""
        for lease in self._versions.expired():
            self.retire(lease)

    def retire(self, lease: Lease) -> None:
        """Queue one version for unloading, unless it is queued already."""
        with self._lock:
            if lease.version in self._pending:
                return
            self._pending.add(lease.version)
        self._queue.put(lease)

    def _run(self) -> None:
        while (lease := self._queue.get()) is not None:
            try:
                self._retire(lease)
            finally:
                with self._lock:
                    self._pending.discard(lease.version)
                self._queue.task_done()

    def _retire(self, lease: Lease) -> None:
        if not self._versions.wait_drained(lease.version, self._timeout_s):
            self.failed += 1
            logger.warning(
                "adapter %s still has %d request(s) in flight after %.1f s; it stays loaded",
                lease.name, self._versions.in_flight(lease.version), self._timeout_s,
            )
            return
        earlier = self._calls.get(lease.version)
        if earlier is not None and earlier.is_alive():
            return  # its earlier unload call has not returned; do not pile up more on the engine
        outcome: list[bool] = []
        # The unload runs on its own daemon thread, so a call that never returns (SGLang's leaked
        # usage counter) costs this queue only the timeout; the next versions still retire.
        call = threading.Thread(target=self._call_unload, args=(lease.name, outcome), daemon=True)
        self._calls[lease.version] = call
        call.start()
        call.join(self._timeout_s)
        if call.is_alive():
            self.failed += 1
            logger.warning("unloading adapter %s did not return within %.1f s; trying again later",
                           lease.name, self._timeout_s)
        elif outcome and outcome[0]:
            self._versions.mark_retired(lease.version)
            self._calls.pop(lease.version, None)
            self.retired += 1
        else:
            self.failed += 1
            logger.warning("adapter %s did not drain in the engine within %.1f s; trying again later",
                           lease.name, self._timeout_s / 2)

    def _call_unload(self, name: str, outcome: list[bool]) -> None:
        try:
            outcome.append(bool(self._unload(name, self._timeout_s / 2)))  # answered before our join ends
        except Exception as err:  # noqa: BLE001 (an unload failure must never reach the trainer)
            logger.warning("unloading adapter %s failed: %s", name, err)
            outcome.append(False)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until queued retirements have finished (tests and shutdown); False on timeout."""
        done = threading.Event()
        threading.Thread(target=lambda: (self._queue.join(), done.set()), daemon=True).start()
        return done.wait(timeout_s)

    def close(self) -> None:
        """Stop the thread after the queued work; an unload stuck in the engine is abandoned."""
        self._queue.put(None)
