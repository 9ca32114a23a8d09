"""N independent engine replicas as rank 0 sees them: which are live, which adapter versions each holds,
how much rollout work each has in flight, and the background revival of one that failed.

A replica that fails or times out is quarantined: nothing is sent to it and no rollout goes to it, and
the requests still in flight on it are ended at once (they go to the others). While a replica has work
in flight (rollouts, or a fan-out call), a watch thread asks its LIVE route (a no-op through its engine
core) every `health_timeout_s / 2`; a replica that does not answer within `health_timeout_s` is
quarantined, so a frozen replica costs the step at most 1.5 x `health_timeout_s`. A
daemon thread brings it back (an embedded engine is restarted if it is dead or hung; an attached one is
probed until it answers, bounded by `[weight_sync] engine_start_timeout_s`), checks its base (when its
incarnation lacks ours: the base it loaded itself is verified by digest against the trainer's, and made
ours at once when every digest matches; otherwise it waits, out of rollouts, for the syncer's next sync,
whose collective stream sends it what differs: rank 0 keeps no copy of the base), then re-feeds the newest
adapter version, again until no newer one came meanwhile, and only then marks it live. Training never
waits on it. After
`[weight_sync] engine_restarts + 1` failed revivals it stays out, and the job goes on with the others.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

from titan_lora.clients.base import AdapterPayload, Emitter, Endpoint, VerifiesBase, verify_ack
from titan_lora.clients.launch import EmbeddedEngine
from titan_lora.clients.rollout import RolloutClient
from titan_lora.config import BACKOFF_CAP_S, WeightSync
from titan_lora.transfer.errors import EngineDied, EngineUnreachable, TransferError

logger = logging.getLogger(__name__)


class NoLiveReplica(EngineDied):
    """No replica is live (or none holds the version asked for): the syncer's recovery waits for one."""


@dataclasses.dataclass(eq=False)
class Replica:
    """One engine of the set, and rank 0's record of it."""

    index: int
    endpoint: Endpoint
    emitter: Emitter
    rollouts: RolloutClient | None = None
    engine: EmbeddedEngine | None = None
    """The process, when titan_lora started it (restarted on revival); None: attached."""
    live: bool = True
    held: dict[int, str] = dataclasses.field(default_factory=dict)
    """Adapter versions it acknowledged and still holds: version -> name."""
    base_incarnation: str | None = None
    """Its incarnation when it acknowledged our base; another one lacks it."""
    outstanding: int = 0
    """Samples (or scored sequences) in flight on it now."""
    assigned: int = 0
    """Work routed to it in all (samples and scored sequences): breaks ties between idle replicas."""
    samples: int = 0
    """Samples generated on it since the last report."""
    quarantines: int = 0
    rejoins: int = 0
    awaiting_base: bool = False
    """Back after a revival, but its base is not verified as ours: the next sync sends it (collective)."""
    busy: Future | None = None
    """The last fan-out call on its emitter, which a revival lets finish before it reuses the emitter."""
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    """Its figures of the last adapter it acknowledged (ms)."""

    def __str__(self) -> str:
        return f"replica {self.index} ({self.endpoint.url})"

    def working(self) -> bool:
        """Whether rollouts or a fan-out call wait on it now."""
        return self.outstanding > 0 or (self.busy is not None and not self.busy.done())

    def interrupt(self, reason: str) -> None:
        """End every request in flight on it (they raise EngineHung): its work goes to the others."""
        self.emitter.interrupt(reason)
        if self.rollouts is not None:
            self.rollouts.interrupt(reason)


class ReplicaSet:
    """The replicas of one job, their state under one lock, and their revival threads."""

    def __init__(self, replicas: list[Replica], ws: WeightSync) -> None:
        if not replicas:
            raise ValueError("a replica set needs at least one engine")
        self.replicas = replicas
        self.cfg = ws
        self._lock = threading.Lock()
        self._ours: dict | None = None  # the trainer's base digests ({"dtype", "digests"}), once known
        self._base_version = 0
        self._latest: AdapterPayload | None = None
        self._revivals: dict[int, threading.Thread] = {}
        self._closing = threading.Event()
        self._checks = ThreadPoolExecutor(max_workers=len(replicas), thread_name_prefix="titan-replica-check")
        self._watch = threading.Thread(target=self._watch_live, name="titan-replica-watch", daemon=True)
        self._watch.start()

    # ---- state -------------------------------------------------------------------------------------
    def live(self) -> list[Replica]:
        """The replicas that take syncs and rollouts now."""
        with self._lock:
            return [r for r in self.replicas if r.live]

    def quarantine(self, replica: Replica, reason: str) -> None:
        """Take `replica` out of syncs and rollouts and start its revival (once: a second call is a no-op)."""
        with self._lock:
            if not replica.live or self._closing.is_set():
                return
            replica.live = False
            replica.quarantines += 1
            thread = threading.Thread(target=self._revive, args=(replica,), daemon=True,
                                      name=f"titan-replica-{replica.index}-revival")
            self._revivals[replica.index] = thread
        logger.warning("%s quarantined: %s; reviving it in the background", replica, reason)
        replica.interrupt(f"{replica} quarantined: {reason}")
        thread.start()

    def revive_again(self, replica: Replica, reason: str) -> None:
        """Start another revival of a replica that came back but failed to take our base."""
        with self._lock:
            if self._closing.is_set():
                return
            replica.awaiting_base = False
            thread = threading.Thread(target=self._revive, args=(replica,), daemon=True,
                                      name=f"titan-replica-{replica.index}-revival")
            self._revivals[replica.index] = thread
        logger.warning("%s: %s; reviving it again", replica, reason)
        thread.start()

    def _watch_live(self) -> None:
        """Quarantine a working replica whose engine core does not answer LIVE within health_timeout_s."""
        timeout_s = self.cfg.health_timeout_s
        while not self._closing.wait(timeout_s / 2):
            with self._lock:
                working = [r for r in self.replicas if r.live and r.working()]
            checks = {r: self._checks.submit(r.emitter.check_live, timeout_s) for r in working}
            for replica, check in checks.items():
                try:
                    check.result()
                except EngineUnreachable as err:  # wedged, dead or gone: its work goes to the others
                    self.quarantine(replica, f"it failed its liveness check with work in flight: {err}")
                except TransferError as err:  # e.g. a refused key: says nothing of a wedge
                    logger.debug("%s: liveness check not made: %s", replica, err)

    def pick(self, adapter: str | None, work: int, exclude: set[int]) -> Replica:
        """The live replica holding `adapter` (None: any) with the least work in flight; `work` is added to
        its count (give it back with `done`)."""
        with self._lock:
            ready = [r for r in self.replicas if r.live and r.index not in exclude
                     and (adapter is None or adapter in r.held.values())]
            if not ready:
                states = ", ".join(f"{r}: {'live' if r.live else 'quarantined'}, holds "
                                   f"{sorted(r.held.values()) or 'no adapter'}" for r in self.replicas)
                raise NoLiveReplica(f"no live replica serves {adapter or 'the base'} ({states})")
            chosen = min(ready, key=lambda r: (r.outstanding, r.assigned, r.index))
            chosen.outstanding += work
            chosen.assigned += work
            return chosen

    def done(self, replica: Replica, work: int, samples: int = 0) -> None:
        """`work` picked on `replica` has ended, having generated `samples` (counted in its report)."""
        with self._lock:
            replica.outstanding -= work
            replica.samples += samples

    def forget(self, replica: Replica, version: int) -> None:
        """`replica` unloaded `version`."""
        with self._lock:
            replica.held.pop(version, None)

    def based(self, replica: Replica, incarnation: str) -> None:
        """`replica` acknowledged our base in `incarnation`: it holds no adapter of ours yet."""
        with self._lock:
            replica.held.clear()
            replica.base_incarnation = incarnation

    def holds(self, replica: Replica, payload: AdapterPayload) -> None:
        """`replica` acknowledged `payload`."""
        with self._lock:
            replica.held[payload.version] = payload.name

    # ---- what a revival re-feeds -------------------------------------------------------------------
    def remember_base(self, ours: dict, version: int) -> None:
        """The trainer's base digests ({"dtype", "digests"}), for revivals to verify a replica's own base."""
        with self._lock:
            self._ours, self._base_version = ours, version

    def awaiting(self) -> list[Replica]:
        """The revived replicas whose base the next sync must send."""
        with self._lock:
            return [r for r in self.replicas if r.awaiting_base]

    def keep_latest(self, payload: AdapterPayload) -> None:
        """Keep a private copy of the newest version (the gather rewrites its buffer at the next step): a
        replica may fail at any moment, and its revival installs this copy."""
        copy = dataclasses.replace(payload, tensors={k: t.clone() for k, t in payload.tensors.items()}, home=None)
        with self._lock:
            if self._latest is None or self._latest.version < copy.version:
                self._latest = copy

    # ---- revival -----------------------------------------------------------------------------------
    def _revive(self, replica: Replica) -> None:
        attempts = self.cfg.engine_restarts + 1
        for attempt in range(attempts):
            if self._closing.is_set():
                return
            try:
                self._settle(replica)
                self._bring_back(replica)
                self._refeed(replica)
                return
            except Exception as err:  # noqa: BLE001 (a revival never reaches the trainer: it retries, then gives up)
                logger.warning("reviving %s failed (%d of %d): %s", replica, attempt + 1, attempts, err)
                self._closing.wait(min(2.0**attempt, BACKOFF_CAP_S))
        logger.error("%s stays out: %d revivals failed ([weight_sync] engine_restarts = %d); the job goes on "
                     "with the other replicas", replica, attempts, self.cfg.engine_restarts)

    def _settle(self, replica: Replica) -> None:
        """Let a fan-out call still running on its emitter end (its requests are bounded by timeout_s)."""
        if replica.busy is not None:
            futures_wait([replica.busy], timeout=self.cfg.timeout_s * (self.cfg.retries + 1) + BACKOFF_CAP_S)

    def _bring_back(self, replica: Replica) -> None:
        if replica.engine is not None:
            replica.engine.ensure_running()  # a dead or hung one is SIGKILLed and started again
            return
        deadline = time.monotonic() + self.cfg.engine_start_timeout_s
        while True:
            try:  # its core too: a wedged one behind a live API server must not rejoin
                replica.emitter.check_live(self.cfg.health_timeout_s)
                replica.emitter.engine_incarnation()
                return
            except EngineUnreachable as err:
                if time.monotonic() > deadline or self._closing.is_set():
                    raise EngineUnreachable(f"{replica} did not answer within {self.cfg.engine_start_timeout_s:.0f} "
                                            f"s ([weight_sync] engine_start_timeout_s): {err}") from None
                self._closing.wait(min(self.cfg.health_timeout_s, 2.0))

    def _refeed(self, replica: Replica) -> None:
        """Its base verified (or left to the next sync), then the newest version until no newer one came; live."""
        if replica.emitter.engine_incarnation() != replica.base_incarnation:
            with self._lock:
                replica.held.clear()
            if not self._verify_base(replica):
                with self._lock:
                    replica.awaiting_base = True
                logger.warning("%s is back without our base (its own differs or cannot be verified): the next "
                               "sync sends it", replica)
                return
        self.rejoin(replica)

    def _verify_base(self, replica: Replica) -> bool:
        """Whether the base `replica` loaded itself has every digest of ours; then it is recorded as ours."""
        with self._lock:
            ours, version = self._ours, self._base_version
        if ours is None or not isinstance(replica.emitter, VerifiesBase):
            return False
        record = replica.emitter.base_digests()
        if record["dtype"] != ours["dtype"] or any(record["digests"].get(n) != d for n, d in ours["digests"].items()):
            return False
        replica.emitter.adopt_base(version)
        self.based(replica, replica.emitter.engine_incarnation())
        logger.info("%s: its own base has every digest of ours: verified, nothing sent", replica)
        return True

    def rejoin(self, replica: Replica) -> None:
        """`replica` holds our base: install the newest adapter version until no newer one came, then live."""
        while True:
            with self._lock:
                latest = self._latest
                if latest is None or max(replica.held, default=-1) >= latest.version:
                    newest = max(replica.held, default=None)
                    stale = {v: n for v, n in replica.held.items() if v != newest}
                    replica.awaiting_base = False
                    replica.live = True
                    replica.rejoins += 1
                    break
            replica.phases = self._install(replica, latest)
        for version, name in stale.items():  # versions older than the newest: no rollout is routed to them
            self._unload(replica, version, name)
        logger.warning("%s rejoined with the base and %s", replica,
                       "no adapter yet" if newest is None else f"adapter version {newest}")

    def _install(self, replica: Replica, payload: AdapterPayload) -> dict[str, float]:
        started = time.perf_counter()
        ack = replica.emitter.send_adapter(payload)
        verify_ack(ack, payload.version, payload.num_tensors, payload.nbytes, f"adapter {payload.name} on {replica}")
        self.holds(replica, payload)
        return {**ack.phases_ms, "total_ms": (time.perf_counter() - started) * 1e3}

    def _unload(self, replica: Replica, version: int, name: str) -> None:
        try:
            if replica.emitter.retire_adapter(name, self.cfg.retire_timeout_s):
                self.forget(replica, version)
        except Exception as err:  # noqa: BLE001 (best effort: a slot it keeps is reclaimed by its next restart)
            logger.warning("unloading %s from %s failed: %s", name, replica, err)

    # ---- reports and shutdown ----------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """TensorBoard scalars: live replicas, and per replica its state, counts, samples routed since the
        last report and the figures of the last adapter it acknowledged."""
        with self._lock:
            out = {"sync/live_replicas": float(sum(r.live for r in self.replicas))}
            for r in self.replicas:
                tag = f"replica{r.index}"
                out |= {f"{tag}/live": float(r.live), f"{tag}/quarantines": float(r.quarantines),
                        f"{tag}/rejoins": float(r.rejoins), f"{tag}/samples": float(r.samples),
                        f"{tag}/versions_held": float(len(r.held))}
                out |= {f"{tag}/{k}": float(v) for k, v in r.phases.items()}
                r.samples = 0
        return out

    def each(self, fn: Callable[[Replica], None], replicas: Iterable[Replica] | None = None) -> None:
        """Run `fn` on every replica (or those given), logging failures: for shutdown."""
        for r in self.replicas if replicas is None else replicas:
            try:
                fn(r)
            except Exception as err:  # noqa: BLE001 (shutdown goes on for the others)
                logger.warning("%s: %s", r, err)

    def close(self) -> None:
        """Stop revivals, then the embedded engines (they release their mappings), then the emitters."""
        self._closing.set()
        self._watch.join(timeout=self.cfg.health_timeout_s + 5)
        self._checks.shutdown(wait=False, cancel_futures=True)
        self.each(lambda r: r.engine.stop(), [r for r in self.replicas if r.engine is not None])
        for thread in list(self._revivals.values()):
            thread.join(timeout=30)  # a start in progress fails at once: its process was stopped
        self.each(lambda r: r.emitter.close())
