"""Retirer: expired versions are unloaded off the training path, only once drained, bounded in time."""

from __future__ import annotations

import threading
import time

import pytest
from lease_helpers import hold_lease

from titan_lora.sync.retire import Retirer
from titan_lora.sync.versions import AdapterVersions


class FakeUnload:
    """Records unload calls; behaves as told (succeed, fail, raise, or block)."""

    def __init__(self, behaviour: str = "ok", block: threading.Event | None = None) -> None:
        self.behaviour = behaviour
        self.block = block
        self.calls: list[tuple[str, float]] = []
        self.lock = threading.Lock()
        self.returned = threading.Event()  # a hanging call has returned

    def __call__(self, name: str, timeout_s: float) -> bool:
        with self.lock:
            self.calls.append((name, timeout_s))
        if self.behaviour == "raise":
            raise ConnectionError("engine went away")
        if self.behaviour == "slow":  # an engine that honours the timeout, then gives up
            time.sleep(timeout_s)
            return False
        if self.behaviour == "hang" and self.block is not None:  # an unload that never returns
            self.block.wait(60)
            self.returned.set()
            return False
        return self.behaviour == "ok"

    @property
    def names(self) -> list[str]:
        with self.lock:
            return [n for n, _ in self.calls]


def _versions(*steps: int, keep: int = 2) -> AdapterVersions:
    v = AdapterVersions("policy", keep)
    for s in steps:
        v.publish(s)
    return v


def test_expired_versions_are_unloaded_and_marked_retired() -> None:
    v = _versions(1, 2, 3, 4)
    unload = FakeUnload()
    r = Retirer(v, unload, timeout_s=5)
    r.schedule_expired()
    assert r.wait_idle(5)
    assert unload.names == ["policy-v1", "policy-v2"]
    assert all(t == 2.5 for _, t in unload.calls), "the engine drains for half the time we wait for it"
    assert v.live == [3, 4] and r.retired == 2 and r.failed == 0
    r.schedule_expired()  # nothing left outside the window: no further unloads
    assert r.wait_idle(5) and unload.names == ["policy-v1", "policy-v2"]
    r.close()


def test_scheduling_twice_queues_a_version_once() -> None:
    v = _versions(1, 2, 3)
    gate = threading.Event()
    unload = FakeUnload("hang", block=gate)
    r = Retirer(v, unload, timeout_s=5)
    r.schedule_expired()
    r.schedule_expired()
    gate.set()
    assert r.wait_idle(5)
    assert unload.names == ["policy-v1"]
    r.close()


def test_a_leased_version_is_unloaded_only_after_it_drained() -> None:
    v = _versions(1)
    entered, release, done = threading.Event(), threading.Event(), threading.Event()

    def rollout() -> None:
        with v.lease():
            entered.set()
            release.wait(10)
        done.set()

    t = threading.Thread(target=rollout)
    t.start()
    assert entered.wait(5)
    v.publish(2)
    v.publish(3)  # version 1 is now outside the window, but a request still uses it
    unload = FakeUnload()
    r = Retirer(v, unload, timeout_s=10)
    r.schedule_expired()
    time.sleep(0.3)
    assert unload.calls == [], "unloading a version with a request in flight"
    assert v.live == [1, 2, 3]
    release.set()
    assert r.wait_idle(5)
    assert done.is_set() and unload.names == ["policy-v1"]
    assert v.live == [2, 3] and r.retired == 1
    t.join(5)
    r.close()


def test_a_version_that_never_drains_costs_the_timeout_and_is_counted() -> None:
    v = _versions(1)
    t, release = hold_lease(v)
    v.publish(2)
    v.publish(3)
    unload = FakeUnload()
    r = Retirer(v, unload, timeout_s=0.3)
    started = time.monotonic()
    r.schedule_expired()
    assert time.monotonic() - started < 0.1, "schedule_expired must not wait for the drain"
    assert r.wait_idle(5)
    assert 0.25 <= time.monotonic() - started < 2.0
    assert unload.calls == [] and r.failed == 1 and r.retired == 0
    assert v.live == [1, 2, 3], "a version that did not drain stays loaded"
    release.set()
    t.join(5)
    r.schedule_expired()  # retried on the next sync, now drained
    assert r.wait_idle(5) and unload.names == ["policy-v1"] and v.live == [2, 3]
    r.close()


def test_a_slow_unload_costs_only_its_timeout_and_is_counted() -> None:
    v = _versions(1, 2, 3)
    unload = FakeUnload("slow")
    r = Retirer(v, unload, timeout_s=0.3)
    started = time.monotonic()
    r.schedule_expired()
    assert time.monotonic() - started < 0.1, "the trainer's thread never waits on an unload"
    assert r.wait_idle(5)
    assert time.monotonic() - started < 2.0
    assert r.failed == 1 and r.retired == 0 and v.live == [1, 2, 3]
    r.close()


def test_an_unload_that_raises_never_reaches_the_caller() -> None:
    v = _versions(1, 2, 3)
    unload = FakeUnload("raise")
    r = Retirer(v, unload, timeout_s=1)
    r.schedule_expired()  # must not raise
    assert r.wait_idle(5)
    assert r.failed == 1 and r.retired == 0 and v.live == [1, 2, 3]
    unload.behaviour = "ok"  # the engine is back: the next sync's schedule retries
    r.schedule_expired()
    assert r.wait_idle(5) and v.live == [2, 3] and r.retired == 1
    r.close()


def test_an_unload_refused_by_the_engine_is_counted() -> None:
    v = _versions(1, 2, 3)
    r = Retirer(v, FakeUnload("refuse"), timeout_s=1)
    r.schedule_expired()
    assert r.wait_idle(5)
    assert r.failed == 1 and r.retired == 0 and v.live == [1, 2, 3]
    r.close()


def test_an_unload_that_hangs_costs_only_its_timeout_and_later_versions_still_retire() -> None:
    # The SGLang failure mode: /unload_lora_adapter never returns. The retirer must give up on it
    # after its timeout, count it, and keep retiring later versions (else memory creeps).
    v = _versions(1, 2, 3)
    gate = threading.Event()
    unload = FakeUnload("hang", block=gate)
    r = Retirer(v, unload, timeout_s=0.3)
    try:
        r.schedule_expired()
        deadline = time.monotonic() + 3.0
        while r.failed == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.failed == 1, "a hanging unload was not counted within a few times its timeout"
        unload.behaviour = "ok"
        v.publish(4)  # version 2 expires too
        r.schedule_expired()
        deadline = time.monotonic() + 3.0
        while "policy-v2" not in unload.names and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "policy-v2" in unload.names, "a hung unload blocked every later retirement"
    finally:
        gate.set()
        r.close()


@pytest.mark.parametrize("timeout_s", [0, -1.0])
def test_a_retire_timeout_that_is_not_positive_is_refused(timeout_s: float) -> None:
    with pytest.raises(ValueError, match=r"\[weight_sync\] retire_timeout_s must be > 0"):
        Retirer(_versions(1), FakeUnload(), timeout_s=timeout_s)


class NotYetThenOk:
    """An engine that drains for the time it is given, plus a round trip, and answers "not drained
    yet" the first time, "unloaded" the second."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    def __call__(self, name: str, timeout_s: float) -> bool:
        self.calls.append(timeout_s)
        time.sleep(timeout_s + 0.1)
        return len(self.calls) > 1


def test_an_unload_answered_not_yet_is_retried_at_the_next_schedule() -> None:
    v = _versions(1, 2, 3)
    unload = NotYetThenOk()
    r = Retirer(v, unload, timeout_s=0.6)
    r.schedule_expired()
    assert r.wait_idle(5)
    assert r.failed == 1 and v.live == [1, 2, 3]
    r.schedule_expired()
    assert r.wait_idle(5)
    assert unload.calls == [0.3, 0.3], "the engine must be asked to drain for half the join"
    assert v.live == [2, 3] and r.retired == 1


def test_a_stuck_unload_is_not_piled_up_and_is_retried_once_it_returned() -> None:
    v = _versions(1, 2, 3)
    gate = threading.Event()
    unload = FakeUnload("hang", block=gate)
    r = Retirer(v, unload, timeout_s=0.3)
    try:
        r.schedule_expired()
        assert r.wait_idle(5) and r.failed == 1
        r.schedule_expired()  # the first call still hangs in the engine: no second call
        assert r.wait_idle(5) and unload.names == ["policy-v1"]
        unload.behaviour = "ok"
        gate.set()  # the stuck call returns at last
        assert unload.returned.wait(5)
        time.sleep(0.05)  # let its thread end after the return
        r.schedule_expired()
        assert r.wait_idle(5)
        assert unload.names == ["policy-v1", "policy-v1"] and v.live == [2, 3] and r.retired == 1
    finally:
        gate.set()
        r.close()


# ---- counts, log lines, threads ---------------------------------------------------------------------
# Other tests' retirers may still be unloading in the background: these tests use adapter names of their
# own and look only at the log lines that name them.


def _named(lora_name: str, *steps: int, keep: int = 2) -> AdapterVersions:
    v = AdapterVersions(lora_name, keep)
    for s in steps:
        v.publish(s)
    return v


def _lines(caplog: pytest.LogCaptureFixture, lora_name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "titan_lora.sync.retire" and f" {lora_name}-v" in r.getMessage()]


def test_the_retirer_runs_on_a_named_daemon_thread() -> None:
    r = Retirer(_versions(1), FakeUnload(), timeout_s=1)
    try:
        assert r._thread.name == "titan-lora-retirer" and r._thread.daemon is True
    finally:
        r.close()


def test_failures_add_up_and_each_is_logged_with_its_figures(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    v = _named("rt-refused", 1, 2, 3, 4)
    r = Retirer(v, FakeUnload("refused"), timeout_s=1.2)
    with caplog.at_level(logging.WARNING, logger="titan_lora.sync.retire"):
        r.schedule_expired()
        assert r.wait_idle(5)
    assert r.failed == 2 and r.retired == 0 and v.live == [1, 2, 3, 4]
    assert _lines(caplog, "rt-refused") == [
        f"adapter rt-refused-v{k} did not drain in the engine within 0.6 s; trying again later" for k in (1, 2)]


def test_versions_still_leased_are_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    v = _named("rt-leased", 1, 2, 3, 4)
    unload = FakeUnload()
    r = Retirer(v, unload, timeout_s=0.1)
    with _leases(v, 1, 2), caplog.at_level(logging.WARNING, logger="titan_lora.sync.retire"):
        r.schedule_expired()
        assert r.wait_idle(5)
    assert r.failed == 2 and unload.calls == []
    assert _lines(caplog, "rt-leased") == [
        f"adapter rt-leased-v{k} still has 2 request(s) in flight after 0.1 s; it stays loaded" for k in (1, 2)]


class _leases:  # noqa: N801
    """Two leases on each of the given versions, taken while each was active (context manager)."""

    def __init__(self, v: AdapterVersions, *versions: int) -> None:
        self.v, self.versions = v, versions

    def __enter__(self) -> None:
        # lease() takes the active version only: set the counts the way it records them
        with self.v._cond:
            for version in self.versions:
                self.v._leases[version] = 2

    def __exit__(self, *exc) -> None:
        with self.v._cond:
            for version in self.versions:
                self.v._leases.pop(version, None)
            self.v._cond.notify_all()


def test_a_hung_unload_is_counted_logged_and_runs_on_a_daemon_thread(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    v = _named("rt-hung", 1, 2, 3, 4)
    gate = threading.Event()
    daemon: list[bool] = []

    def unload(name: str, timeout_s: float) -> bool:
        daemon.append(threading.current_thread().daemon)
        gate.wait(10)
        return True

    r = Retirer(v, unload, timeout_s=0.2)
    try:
        with caplog.at_level(logging.WARNING, logger="titan_lora.sync.retire"):
            r.schedule_expired()
            assert r.wait_idle(5)
        assert r.failed == 2 and daemon == [True, True]
        assert _lines(caplog, "rt-hung") == [
            f"unloading adapter rt-hung-v{k} did not return within 0.2 s; trying again later" for k in (1, 2)]
    finally:
        gate.set()
        r.close()


def test_an_unload_that_raises_is_logged_with_the_error(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    r = Retirer(_named("rt-raise", 1, 2, 3), FakeUnload("raise"), timeout_s=1)
    with caplog.at_level(logging.WARNING, logger="titan_lora.sync.retire"):
        r.schedule_expired()
        assert r.wait_idle(5)
    assert _lines(caplog, "rt-raise") == ["unloading adapter rt-raise-v1 failed: engine went away",
                                          "adapter rt-raise-v1 did not drain in the engine within 0.5 s; trying "
                                          "again later"] and r.failed == 1


def test_a_retired_version_leaves_no_unload_call_behind() -> None:
    r = Retirer(_versions(1, 2, 3, 4), FakeUnload(), timeout_s=1)
    r.schedule_expired()
    assert r.wait_idle(5) and r.retired == 2 and r._calls == {}


def test_wait_idle_is_bounded_and_its_waiter_is_a_daemon() -> None:
    v = _versions(1, 2, 3)
    gate = threading.Event()
    r = Retirer(v, FakeUnload("hang", block=gate), timeout_s=5)
    try:
        r.schedule_expired()
        before = set(threading.enumerate())
        started = time.monotonic()
        assert r.wait_idle(0.1) is False  # from the main thread: a non-daemon caller
        assert time.monotonic() - started < 3, "wait_idle returned within its timeout"
        waiters = list(set(threading.enumerate()) - before)
        assert waiters and all(t.daemon for t in waiters), "a waiter left behind would keep the process alive"
    finally:
        gate.set()
        r.close()
