"""Rank 0's watch over the engine while an operation waits on it (rollouts, eval, the parity probe, a base
or adapter transfer).

A wedged engine core behind a live API server answers nothing but the server's own routes: a request
waits out its whole timeout (`rollout_timeout_s`, 600 s by default) before anyone looks. So while an
operation runs, a daemon thread asks the engine's LIVE route (a no-op through its engine core and
workers) every `timeout_s / 2`; when it does not answer within `timeout_s`, `on_wedge` ends the
operation's requests at once (an embedded engine is killed, an attached engine's requests are
interrupted) and the operation raises an engine fault, which the syncer recovers from. A wedge is
thereby found within 1.5 x `timeout_s` of any moment an operation waits. Between operations nothing is
asked: the next one finds the engine as it is.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

from titan_lora.transfer.errors import EngineUnreachable

logger = logging.getLogger(__name__)


class Watchdog:
    """Checks `check_live(timeout_s)` every `timeout_s / 2` while an operation is `watching`; on a failed
    check calls `on_wedge(reason)` once for that operation (again at the next failed check if it raised)."""

    def __init__(self, check_live: Callable[[float], None], on_wedge: Callable[[str], None],
                 timeout_s: float) -> None:
        self._check_live = check_live
        self._on_wedge = on_wedge
        self.timeout_s = timeout_s
        self.period_s = timeout_s / 2
        self._lock = threading.Lock()
        self._watching: dict[int, tuple[str, float]] = {}  # operation id -> (what, since)
        self._next_id = 0
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self.wedges = 0
        """Wedges found so far."""
        self.last_wedge_s: float | None = None
        """Seconds from the start of the operation that met the last wedge to its detection."""

    @contextlib.contextmanager
    def watching(self, what: str) -> Iterator[None]:
        """Watch the engine while the body runs (`what` names the operation in the log)."""
        with self._lock:
            op = self._next_id
            self._next_id += 1
            self._watching[op] = (what, time.monotonic())
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="titan-engine-watchdog", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                del self._watching[op]

    def _run(self) -> None:
        reported: set[int] = set()  # operations already ended by `on_wedge`
        while not self._closed.wait(self.period_s):
            with self._lock:
                ops = {op: v for op, v in self._watching.items() if op not in reported}
            if not ops:
                continue
            try:
                self._check_live(self.timeout_s)
            except EngineUnreachable as err:  # hung, dead or refusing: the operation cannot end well
                with self._lock:
                    still = {op: v for op, v in ops.items() if op in self._watching}
                if still:  # else it ended meanwhile: its own outcome tells
                    reported |= self._report(still, err)
            except Exception as err:  # noqa: BLE001 (a check that cannot be made says nothing of a wedge)
                logger.debug("liveness check not made: %s", err)
            with self._lock:
                reported &= self._watching.keys()

    def _report(self, ops: dict[int, tuple[str, float]], err: Exception) -> set[int]:
        """Call `on_wedge` for the waiting `ops`; the operations it ended (none when it raised: the next
        failed check tries again, and the watch goes on either way)."""
        what, since = min(ops.values(), key=lambda v: v[1])
        waited_s = time.monotonic() - since
        logger.warning("the engine failed its liveness check while %s was waiting on it (%.1f s in): "
                       "%s; ending that wait now", what, waited_s, err)
        try:
            self._on_wedge(f"{what}: the engine failed its liveness check: {err}")
        except Exception:  # e.g. a kill whose wait outlasts its bound on a process stuck in the kernel
            logger.exception("ending the wait of %s on the wedged engine failed; the watchdog keeps watching "
                             "and tries again at the next failed check", what)
            return set()
        self.wedges += 1
        self.last_wedge_s = waited_s
        return set(ops)

    def close(self) -> None:
        """Stop the watch thread."""
        self._closed.set()
