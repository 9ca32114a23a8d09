"""The async loop's rollout producer (rank 0): it keeps the engine generating while the ranks train.

Groups are numbered in data order: group g holds prompt g % B of step g // B + 1's problems (B =
`prompts_per_step`), so the data position is the set of groups trained so far (`ProducerState`), which a
checkpoint keeps and a resume restores: nothing is repeated or skipped.

Admission bounds staleness. At most (S + 1) x B groups hold a slot (S = `max_staleness`): running,
finished and waiting in the buffer, or trained by a step whose version the engine has not yet
acknowledged; a trained group frees its slot only once the version its step produced is published. Each
group is one request of `group_size` samples pinned (leased) to the newest published version, so it
finishes on that version however many are published meanwhile, and no group mixes versions.

A step takes the B finished groups that come first in data order; it never waits on a particular group.
A group finished under a version older than (step - 1) - S is never trained: it is dropped, counted and
drawn again under the newest version (the straggler rule, docs/internals.md); a group dropped so
`MAX_STALE_DRAWS` times (its generation outlasts S steps every time) is skipped, counted and logged, so it
cannot pin old versions forever. A group whose request failed is drawn again too; a replica lost under an
older pinned version (`NoLiveReplica` while a newer version is published) only redraws the group under the
newest. An engine fault (a dead or wedged engine) stops admission and is raised by the next
`take`, inside the syncer's collective recovery; once the engine is back (its adapters' generation has
moved on) admission resumes and what failed is drawn again.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator

from titan_lora.clients.replica_set import NoLiveReplica
from titan_lora.rl.rollout import Sample
from titan_lora.sync.versions import Lease, ServedVersions

logger = logging.getLogger(__name__)
POLL_S = 0.2
"""How often the admission loop looks at the published version when nothing woke it."""
MAX_STALE_DRAWS = 3
"""A group dropped as stale this many times is skipped: its generation outlasts S steps every time."""


@dataclasses.dataclass
class Group:
    """One prompt's samples, all drawn under one adapter version."""

    samples: list[Sample]
    version: int


@dataclasses.dataclass
class ProducerState:
    """The data position: every group below `next_group` is trained, and so are `trained_ahead`; groups
    are numbered with `per_step` prompts a step (0: not recorded, an older checkpoint)."""

    next_group: int = 0
    trained_ahead: list[int] = dataclasses.field(default_factory=list)
    per_step: int = 0

    @classmethod
    def at_step(cls, step: int, per_step: int) -> ProducerState:
        """The position of a run that trained steps 1..step in data order (the sync loop's)."""
        return cls(step * per_step, [], per_step)


class BusyClock:
    """Time with at least one rollout request in flight, and the tokens they generated, per lap."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight = 0
        self._since = self._lap_start = time.monotonic()
        self._busy_s = 0.0
        self._tokens = 0

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Count the body as engine time."""
        with self._lock:
            if self._in_flight == 0:
                self._since = time.monotonic()
            self._in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._busy_s += time.monotonic() - self._since

    def add_tokens(self, n: int) -> None:
        """Record `n` generated tokens."""
        with self._lock:
            self._tokens += n

    def lap(self) -> tuple[float, float, int]:
        """(wall s, busy s, tokens) since the previous lap."""
        with self._lock:
            now = time.monotonic()
            busy = self._busy_s + (now - self._since if self._in_flight else 0.0)
            wall, tokens = now - self._lap_start, self._tokens
            self._busy_s, self._tokens, self._lap_start = 0.0, 0, now
            if self._in_flight:
                self._since = now
            return wall, busy, tokens


Draw = Callable[[int, Lease], list[Sample]]
"""Sample group `index` under the leased version (one request), scored and with advantages."""


class RolloutProducer:
    """Keeps up to (S + 1) x B groups admitted; `take` hands a step its B groups."""

    def __init__(self, draw: Draw, versions: ServedVersions, per_step: int, max_staleness: int,
                 clock: BusyClock, state: ProducerState | None = None) -> None:
        self._draw = draw
        self._versions = versions
        self.per_step = per_step
        self.max_staleness = max_staleness
        self.capacity = (max_staleness + 1) * per_step
        self._clock = clock
        state = state or ProducerState(per_step=per_step)
        if state.per_step not in (0, per_step):
            raise ValueError(f"the checkpoint's data position counts {state.per_step} prompts a step, this run "
                             f"[grpo] prompts_per_step = {per_step}: resume with prompts_per_step = {state.per_step}, "
                             "or start a new run ([checkpoint] folder elsewhere)")
        self._next = state.next_group  # every group below it was admitted at least once, or trained
        self._trained = set(state.trained_ahead)  # trained groups at or above the watermark
        self._watermark = state.next_group  # every group below it is trained
        self._redraw: list[int] = []  # sorted: failed or stale groups, drawn again before new ones
        self._running: set[int] = set()  # groups whose request is out
        self._done: dict[int, Group] = {}
        self._unacked: list[tuple[int, int]] = []  # (step, groups): trained, their step not yet published
        self._fault: tuple[BaseException, int] | None = None  # (error, generation it happened in)
        self._stopped = False
        self._taken = 0  # the last step that took its groups
        self.last_taken: list[int] = []  # the groups that step took, in data order
        self._stale_draws: dict[int, int] = {}  # group -> times it was dropped as stale
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._admit_forever, name="titan-producer", daemon=True)
        self.counters = {"admitted": 0, "stale_dropped": 0, "redrawn": 0, "failed": 0, "skipped": 0}

    # ---- admission (its own thread) -----------------------------------------------------------------
    def start(self) -> None:
        """Begin admitting groups (after the engine serves the starting adapter)."""
        self._thread.start()

    def poke(self) -> None:
        """Look at the published version now (one was just published)."""
        with self._cond:
            self._cond.notify_all()

    def _faulted(self) -> bool:
        return self._fault is not None and self._fault[1] >= self._versions.generation

    def _slots_held(self) -> int:
        active = self._versions.active
        published = -1 if active is None else active.version
        self._unacked = [(step, n) for step, n in self._unacked if step > published]
        return len(self._running) + len(self._done) + sum(n for _, n in self._unacked)

    def _next_index(self) -> int:
        if self._redraw:
            return self._redraw.pop(0)
        # A resume's trained-ahead groups join the watermark once the groups below them are trained, and
        # leave `_trained` then: the watermark may pass `_next`, and every group below it is trained.
        self._next = max(self._next, self._watermark)
        while self._next in self._trained:
            self._next += 1
        self._next += 1
        return self._next - 1

    def _admit_forever(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (self._faulted() or self._versions.active is None
                                             or self._slots_held() >= self.capacity):
                    self._cond.wait(POLL_S)
                if self._stopped:
                    return
                index = self._next_index()
                self._running.add(index)
                self.counters["admitted"] += 1
                # A daemon thread per group (admission bounds them): a request hung in a dead engine never
                # holds the process at exit, as a pool's joined workers would; started under the lock, so
                # `close` cannot come between the admission and the start.
                threading.Thread(target=self._run_group, args=(index, self._versions.generation),
                                 name=f"titan-group-{index}", daemon=True).start()

    def _run_group(self, index: int, generation: int) -> None:
        pinned = None
        try:
            with self._versions.lease() as lease, self._clock.busy():
                pinned = lease.version
                samples = self._draw(index, lease)
        except Exception as err:  # noqa: BLE001 (every failure is the trainer's to see, in `take`)
            self._failed(index, generation, pinned, err)
            return
        self._clock.add_tokens(sum(len(s.completion_ids) for s in samples))
        with self._cond:
            self._running.discard(index)
            self._done[index] = Group(samples, lease.version)
            # The next step to take is the earliest that could train it: stale for that one, stale forever.
            self._drop_stale(self._taken - self.max_staleness)
            self._cond.notify_all()

    def _failed(self, index: int, generation: int, pinned: int | None, err: BaseException) -> None:
        with self._cond:
            self._running.discard(index)
            bisect.insort(self._redraw, index)
            self.counters["failed"] += 1
            if self._stopped or isinstance(err, RuntimeError) and self._versions.active is None:
                return  # closing, or the engine lost its adapters under a recovery: drawn again after it
            active = self._versions.active
            if isinstance(err, NoLiveReplica) and pinned is not None and active and pinned < active.version:
                # The replicas that held the old version are gone; a redraw under the newest tells whether
                # any engine is left, without a recovery of the whole set.
                logger.info("rollout group %d: no live replica holds version %d (%s); drawing it again under "
                            "version %d", index, pinned, err, active.version)
                self._cond.notify_all()
                return
            if generation >= self._versions.generation and not self._faulted():  # an older one is past
                self._fault = (err, generation)
                logger.warning("rollout group %d failed (%s: %s); the next step recovers the engine", index,
                               type(err).__name__, err)
            self._cond.notify_all()

    # ---- the trainer's side (rank 0, inside the syncer's collective call) ---------------------------
    def take(self, step: int) -> list[Sample]:
        """Block until B groups trainable at `step` are finished; return their samples in data order.

        Raises the engine fault a group met, once; the syncer recovers the engine and calls again."""
        oldest = step - 1 - self.max_staleness
        with self._cond:
            while True:
                if self._fault is not None:
                    if self._faulted():
                        raise self._fault[0]
                    self._fault = None  # the engine was brought back since: its groups are drawn again
                    self._cond.notify_all()
                if self._stopped or not self._thread.is_alive():
                    raise RuntimeError("the rollout producer was closed, or its admission thread ended")
                self._check_published(step)
                self._drop_stale(oldest)
                ready = sorted(self._done)[: self.per_step]
                if len(ready) == self.per_step:
                    break
                self._cond.wait(POLL_S)
            groups = [self._done.pop(i) for i in ready]
            self._taken, self.last_taken = step, ready
            self._drop_stale(step - self.max_staleness)
            self._unacked.append((step, len(groups)))
            self._mark_trained(ready)
            self._cond.notify_all()
        for g in groups:
            for s in g.samples:
                s.trained_at = step
        return [s for g in groups for s in g.samples]

    def _check_published(self, step: int) -> None:
        """Raise where waiting could never end: no version is published (an engine recovery that could not
        re-send the adapter, or a parity gate holding back the first), or the newest is too old for any group
        drawn now to be trainable at `step` (the engine receives no new versions)."""
        active = self._versions.active
        if active is None:
            raise RuntimeError("no adapter version is active yet: sync before the first rollout")
        if active.version < step - 1 - self.max_staleness:
            raise RuntimeError(
                f"the engine serves version {active.version}, too old for step {step} with [grpo] max_staleness "
                f"= {self.max_staleness}: the engine is not receiving new adapter versions (check [weight_sync] "
                "parity_gate and the engine's log)")

    def _drop_stale(self, oldest: int) -> None:
        for index in [i for i, g in self._done.items() if g.version < oldest]:
            version = self._done.pop(index).version
            self.counters["stale_dropped"] += 1
            drops = self._stale_draws[index] = self._stale_draws.get(index, 0) + 1
            if drops >= MAX_STALE_DRAWS:
                logger.warning("rollout group %d was drawn under too old a version %d times (its generation "
                               "takes longer than [grpo] max_staleness = %d steps); skipping it", index, drops,
                               self.max_staleness)
                del self._stale_draws[index]
                self.counters["skipped"] += 1
                self._mark_trained([index])  # the data position moves past it: never drawn again
                continue
            logger.info("rollout group %d was drawn under version %d, older than %d allows ([grpo] "
                        "max_staleness); drawing it again", index, version, oldest)
            bisect.insort(self._redraw, index)
            self.counters["redrawn"] += 1

    def _mark_trained(self, indices: list[int]) -> None:
        for i in indices:
            self._stale_draws.pop(i, None)
        self._trained.update(indices)
        while self._watermark in self._trained:
            self._trained.discard(self._watermark)
            self._watermark += 1

    def state(self) -> ProducerState:
        """The data position now: what a checkpoint saved after this step keeps."""
        with self._cond:
            return ProducerState(self._watermark, sorted(self._trained), self.per_step)

    def close(self) -> None:
        """Stop admitting; requests in flight are left to the engine's shutdown (their threads are daemons)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
