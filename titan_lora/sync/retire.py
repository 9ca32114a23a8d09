"""Retire adapter versions off the training path: drained first, best effort, bounded in time.

An unload can block on the engine side (SGLang waits for in-flight requests, and leaked usage
counters make that wait endless), so it never runs on the trainer's thread and a stuck unload costs
the trainer nothing: it is counted, logged and left behind.
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
        self._versions = versions
        self._unload = unload
        self._timeout_s = timeout_s
        self._queue: queue.Queue[Lease | None] = queue.Queue()
        self._pending: set[int] = set()
        self._lock = threading.Lock()
        self.retired = 0
        self.failed = 0
        self._thread = threading.Thread(target=self._run, name="titan-lora-retirer", daemon=True)
        self._thread.start()

    def schedule_expired(self) -> None:
        """Queue every version outside the retention window that is not already queued."""
        for lease in self._versions.expired():
            with self._lock:
                if lease.version in self._pending:
                    continue
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
                "adapter %s still has %d request(s) in flight after %.0fs; it stays loaded",
                lease.name, self._versions.in_flight(lease.version), self._timeout_s,
            )
            return
        try:
            done = self._unload(lease.name, self._timeout_s)
        except Exception as err:  # an unload failure must never reach the trainer
            logger.warning("unloading adapter %s failed: %s", lease.name, err)
            done = False
        if done:
            self._versions.mark_retired(lease.version)
            self.retired += 1
        else:
            self.failed += 1
            logger.warning("unloading adapter %s did not finish in %.0fs", lease.name, self._timeout_s)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until queued retirements have finished (tests and shutdown); False on timeout."""
        done = threading.Event()
        threading.Thread(target=lambda: (self._queue.join(), done.set()), daemon=True).start()
        return done.wait(timeout_s)

    def close(self) -> None:
        """Stop the thread after the queued work; an unload stuck in the engine is abandoned."""
        self._queue.put(None)
