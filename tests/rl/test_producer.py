"""RolloutProducer's bookkeeping on real AdapterVersions with a scripted draw: admission bound, slots freed
only by a published version, data order, the straggler rule, faults, and the data position: saved and
restored, every group is trained exactly once across a resume."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import Iterator

import pytest
from wait_helpers import waited

from titan_lora.clients.replica_set import NoLiveReplica
from titan_lora.rl.producer import MAX_STALE_DRAWS, BusyClock, ProducerState, RolloutProducer
from titan_lora.rl.rollout import Sample
from titan_lora.sync.versions import AdapterVersions, Lease
from titan_lora.transfer.errors import EngineDied

B, S = 2, 1  # prompts per step, max staleness: (S + 1) x B = 4 slots


class ScriptedDraw:
    """Each group's request waits until the test releases it; records the version it was pinned to."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.started: dict[int, list[int]] = {}  # group -> versions of its attempts
        self.released: set[int] = set()
        self.fail: dict[int, BaseException] = {}
        self.free_running = False  # True: every group but those `held` finishes at once
        self.held: set[int] = set()

    def __call__(self, index: int, lease: Lease) -> list[Sample]:
        with self.cond:
            self.started.setdefault(index, []).append(lease.version)
            self.cond.notify_all()
            self.cond.wait_for(lambda: index in self.released or index in self.fail
                               or self.free_running and index not in self.held, 10)
            if index in self.fail:
                raise self.fail.pop(index)
            self.released.discard(index)
        return [Sample([1], [2, 3], [0.0, 0.0], 1.0, 0.0, lease.version, f"g{index}", group=index)]

    def release(self, *indices: int) -> None:
        with self.cond:
            self.released.update(indices)
            self.cond.notify_all()

    def wait_started(self, n: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: sum(map(len, self.started.values())) >= n, 10), self.started


@contextlib.contextmanager
def _producer(state: ProducerState | None = None, version: int = 0, per_step: int = B,
              max_staleness: int = S) -> Iterator[tuple[RolloutProducer, ScriptedDraw, AdapterVersions]]:
    """A started producer over a scripted draw, `version` published; closed at the end."""
    versions = AdapterVersions("policy", keep_versions=max_staleness + 2)
    versions.publish(version)  # the resumed step's adapter, as the syncer's first sync publishes it
    draw = ScriptedDraw()
    producer = RolloutProducer(draw, versions, per_step, max_staleness, BusyClock(), state)
    producer.start()
    try:
        yield producer, draw, versions
    finally:
        producer.close()
        with draw.cond:  # end the scripted requests still out, so no test leaves threads behind
            draw.free_running, draw.held = True, set()
            draw.cond.notify_all()


def _settle() -> None:
    time.sleep(0.3)  # > the admission loop's poll: whatever it would admit, it has


def test_admission_stops_at_s_plus_1_steps_of_groups_and_a_slot_frees_only_when_its_step_is_published() -> None:
    with _producer() as (producer, draw, versions):
        draw.wait_started(4)
        _settle()
        assert sorted(draw.started) == [0, 1, 2, 3], "(S + 1) x B = 4 groups admitted, no more"
        draw.release(0, 1)
        samples = producer.take(1)
        assert [s.group for s in samples] == [0, 1] and {s.trained_at for s in samples} == {1}
        _settle()
        assert sorted(draw.started) == [0, 1, 2, 3], "step 1 trained but version 1 not published: no slot free"
        versions.publish(1)
        producer.poke()
        draw.wait_started(6)
        assert sorted(draw.started) == [0, 1, 2, 3, 4, 5]
        assert draw.started[4] == [1] and draw.started[5] == [1], "new groups take the newest version"
        assert draw.started[2] == [0], "a group keeps the version it was admitted under"


def test_a_step_takes_the_first_finished_groups_in_data_order_and_never_waits_on_a_straggler() -> None:
    with _producer() as (producer, draw, versions):
        draw.wait_started(4)
        draw.release(1, 2)  # group 0 straggles
        assert [s.group for s in producer.take(1)] == [1, 2]
        assert producer.state() == ProducerState(0, [1, 2], B), "group 0 is not trained yet: the position keeps it"


def test_a_group_older_than_max_staleness_is_dropped_and_drawn_again_under_the_newest_version() -> None:
    with _producer() as (producer, draw, versions):
        draw.wait_started(4)
        draw.release(1, 2)
        producer.take(1)  # group 0 (version 0) still running
        versions.publish(1)
        producer.poke()
        draw.wait_started(6)
        draw.release(3, 4)
        producer.take(2)  # oldest allowed at step 2: version 0
        versions.publish(2)
        producer.poke()
        draw.release(0)  # version 0 is now 2 versions behind step 3's current version 2
        draw.wait_started(7)
        _settle()
        assert draw.started[0] == [0, 2], "drawn again under version 2"
        draw.release(0, 5)
        samples = producer.take(3)
        assert [(s.group, s.version) for s in samples] == [(0, 2), (5, 1)]
        assert producer.counters["stale_dropped"] == 1
        assert producer.state() == ProducerState(6, [], B)


def test_an_engine_fault_is_raised_once_by_take_and_after_the_recovery_its_group_is_drawn_again() -> None:
    with _producer() as (producer, draw, versions):
        draw.wait_started(4)
        fault = EngineDied("the engine died mid-rollout")
        with draw.cond:
            draw.fail[1] = fault
            draw.cond.notify_all()
        with pytest.raises(EngineDied, match="mid-rollout"):
            producer.take(1)
        _settle()
        assert draw.started[1] == [0], "no admission while the fault is pending"
        versions.forget_all()  # the syncer's recovery: a new engine generation, the version re-published
        versions.publish(0)
        draw.release(0)
        draw.wait_started(5)
        draw.release(1)
        assert [s.group for s in producer.take(1)] == [0, 1]
        assert draw.started[1] == [0, 0] and producer.counters["failed"] == 1


def test_a_resumed_producer_skips_groups_trained_ahead_and_draws_the_untrained_ones_first() -> None:
    with _producer(ProducerState(next_group=4, trained_ahead=[5]), version=2) as (producer, draw, _):
        draw.wait_started(4)
        assert sorted(draw.started) == [4, 6, 7, 8], "group 5 was trained before the checkpoint"
        draw.release(4, 6)
        assert [s.group for s in producer.take(3)] == [4, 6]
        assert producer.state() == ProducerState(7, [], B)


def _train(producer: RolloutProducer, versions: AdapterVersions, steps: range,
           held_back: tuple[int, ...] = ()) -> list[int]:
    """Take `steps` in turn, publishing each step's version (unless a parity gate holds it back); the groups
    trained, in the order trained."""
    trained = []
    for step in steps:
        producer.take(step)
        trained += producer.last_taken
        if step not in held_back:
            versions.publish(step)
            producer.poke()
    return trained


def _covered(position: ProducerState) -> set[int]:
    """The groups a data position says are trained."""
    return set(range(position.next_group)) | set(position.trained_ahead)


def _check_once(before: ProducerState, trained: list[int], after: ProducerState, drawn: set[int]) -> None:
    """Across a resume at `before`: no group trained twice, the position `after` is exactly what was trained,
    and no group below the last trained one passed over without being drawn."""
    assert len(trained) == len(set(trained)), f"a group trained twice: {trained}"
    assert not set(trained) & _covered(before), f"a group trained before the checkpoint again: {trained}"
    assert _covered(after) == _covered(before) | set(trained), "the position is what was trained"
    assert set(range(max(trained))) <= _covered(after) | drawn, "a group was skipped"


@pytest.mark.parametrize(("per_step", "max_staleness", "state", "held_back"), [
    (1, 0, ProducerState(10, [11], 1), ()),  # the watermark passes the next new group at step 11
    (1, 1, ProducerState(10, [11], 1), (11,)),  # the parity gate holds back version 11
    (1, 1, ProducerState(10, [12], 1), (12,)),
    (1, 2, ProducerState(10, [11, 13], 1), (12,)),
    (2, 0, ProducerState(10, [11, 12, 13], 2), ()),
    (2, 1, ProducerState(10, [12, 14, 15], 2), (7,)),
    (3, 1, ProducerState(9, [10, 11, 14], 3), (5, 7)),
], ids=str)
def test_a_resumed_producer_trains_every_group_once_whatever_was_trained_ahead(
        per_step: int, max_staleness: int, state: ProducerState, held_back: tuple[int, ...]) -> None:
    resumed_at = state.next_group // per_step  # the checkpoint's step
    with _producer(state, resumed_at, per_step, max_staleness) as (producer, draw, versions):
        with draw.cond:
            draw.free_running = True
            draw.cond.notify_all()
        trained = _train(producer, versions, range(resumed_at + 1, resumed_at + 7), held_back)
        _check_once(state, trained, producer.state(), set(draw.started))


@pytest.mark.parametrize(("per_step", "max_staleness", "resumed_staleness"),
                         [(1, 1, 1), (2, 1, 1), (2, 2, 2), (3, 1, 1), (2, 2, 0), (2, 1, 3), (1, 2, 0)])
def test_every_group_is_trained_exactly_once_across_a_checkpoint_and_resume(
        per_step: int, max_staleness: int, resumed_staleness: int) -> None:
    # Group 0 straggles until after the checkpoint, so the position it keeps has groups trained ahead of
    # it; the resumed run may have another max_staleness (the data position does not depend on it).
    with _producer(per_step=per_step, max_staleness=max_staleness) as (producer, draw, versions):
        with draw.cond:
            draw.free_running, draw.held = True, {0}
            draw.cond.notify_all()
        before = _train(producer, versions, range(1, 3))
        saved = producer.state()
    assert saved == ProducerState(0, sorted(before), per_step), "the checkpoint holds groups trained ahead"
    restored = ProducerState(**json.loads(json.dumps(dataclasses.asdict(saved))))  # as a checkpoint keeps it
    with _producer(restored, 2, per_step, resumed_staleness) as (producer, draw, versions):
        with draw.cond:
            draw.free_running = True
            draw.cond.notify_all()
        after = _train(producer, versions, range(3, 9))
        _check_once(restored, after, producer.state(), set(draw.started))
    assert 0 in after, "the straggler is trained after the resume"


def test_the_busy_clock_counts_time_with_any_request_in_flight_once() -> None:
    clock = BusyClock()
    clock.lap()
    with clock.busy():
        with clock.busy():
            time.sleep(0.05)
        time.sleep(0.05)
    time.sleep(0.05)
    clock.add_tokens(7)
    wall, busy, tokens = clock.lap()
    assert 0.1 <= busy < 0.14 and wall >= 0.15 and tokens == 7


def test_take_raises_instead_of_waiting_forever_when_no_version_is_published() -> None:
    # A recovery re-sent the base (the record cleared) but could not re-send the adapter: nothing is
    # admitted, so a wait would never end; the syncer's recovery must see an error instead.
    with _producer() as (producer, draw, versions):
        draw.wait_started(4)
        versions.forget_all()
        with pytest.raises(RuntimeError, match="no adapter version is active"):
            producer.take(1)


def test_take_raises_when_the_engine_gets_no_new_versions() -> None:
    # Version 0 is still the newest at step 3 (a parity gate holding every version back): with S = 1 no
    # group drawn now could ever be trained, as the sync loop's staleness filter says too.
    with _producer() as (producer, draw, _):
        draw.wait_started(4)
        with pytest.raises(RuntimeError, match="serves version 0, too old for step 3"):
            producer.take(3)


def test_a_group_stale_every_time_it_finishes_is_skipped_after_max_stale_draws_and_the_position_moves_past_it():
    # Group 0's generation outlasts S + 1 steps each time: redrawing it for ever would pin an old version
    # and hold a slot for ever.
    with _producer() as (producer, draw, versions):
        with draw.cond:
            draw.free_running, draw.held = True, {0}
            draw.cond.notify_all()
        step = 0
        for attempt in range(1, MAX_STALE_DRAWS + 1):
            draw.wait_started(1)
            for _ in range(S + 1):  # group 0 is now S + 1 versions behind
                step += 1
                assert 0 not in [s.group for s in producer.take(step)]
                versions.publish(step)
                producer.poke()
            draw.release(0)
            if attempt < MAX_STALE_DRAWS:  # (other groups may age in the buffer too: count group 0's own)
                assert waited(lambda: len(draw.started[0]) == attempt + 1), "drawn again under the newest"
        assert waited(lambda: producer.counters["skipped"] == 1)
        _settle()
        assert draw.started[0] == [0, 2, 4], "three attempts, each under the version then newest; no fourth"
        position = producer.state()
        assert position.next_group > 0 and 0 not in position.trained_ahead, "the data position moved past it"


def test_a_replica_lost_under_an_older_pinned_version_redraws_the_group_without_an_engine_fault() -> None:
    with _producer() as (producer, draw, versions):
        draw.wait_started(4)
        versions.publish(1)  # group 1 was pinned to version 0
        with draw.cond:
            draw.fail[1] = NoLiveReplica("no live replica serves policy-v0")
            draw.cond.notify_all()
        assert waited(lambda: draw.started.get(1) == [0, 1]), "drawn again under the newest version at once"
        draw.release(0, 1)
        assert [(s.group, s.version) for s in producer.take(1)] == [(0, 0), (1, 1)], "no fault was raised"
        assert producer.counters["failed"] == 1
        assert waited(lambda: 4 in draw.started) and draw.started[4] == [1]
        with draw.cond:  # under the newest version, no replica left is an engine fault
            draw.fail[4] = NoLiveReplica("no live replica serves policy-v1")
            draw.cond.notify_all()
        with pytest.raises(NoLiveReplica):
            producer.take(2)


def test_a_checkpoint_of_another_prompts_per_step_is_refused() -> None:
    versions = AdapterVersions("policy", keep_versions=S + 2)
    with pytest.raises(ValueError, match="counts 3 prompts a step.*prompts_per_step = 2.*prompts_per_step = 3"):
        RolloutProducer(ScriptedDraw(), versions, B, S, BusyClock(), ProducerState(6, [], per_step=3))


def test_group_requests_run_on_daemon_threads_so_a_hung_request_never_holds_the_process_at_exit() -> None:
    before = set(threading.enumerate())
    with _producer() as (producer, draw, _):
        draw.wait_started(4)
        groups = [t for t in set(threading.enumerate()) - before if t.name.startswith("titan-group-")]
        assert len(groups) == 4 and all(t.daemon for t in groups)
        producer.close()
        draw.release(0, 1, 2, 3)
        assert waited(lambda: not any(t.is_alive() for t in groups))
