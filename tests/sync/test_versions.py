"""AdapterVersions: the one source of truth for live adapter versions, the active one and leases."""

from __future__ import annotations

import threading
import time

import pytest
from lease_helpers import hold_lease

from titan_lora.sync.versions import AdapterVersions, Lease, versioned_name


def test_versioned_name() -> None:
    assert versioned_name("policy", 12) == "policy-v12"


def test_keep_versions_must_be_positive() -> None:
    with pytest.raises(ValueError, match="keep_versions"):
        AdapterVersions("policy", 0)


def test_nothing_active_before_the_first_publish() -> None:
    v = AdapterVersions("policy", 2)
    assert v.active is None and v.live == [] and v.expired() == []
    with pytest.raises(RuntimeError, match="sync before the first rollout"):
        with v.lease():
            pass


def test_publish_makes_the_version_active_and_live() -> None:
    v = AdapterVersions("policy", 2)
    assert v.publish(3) == "policy-v3"
    assert v.active == Lease("policy-v3", 3)
    assert v.publish(5) == "policy-v5"
    assert v.active == Lease("policy-v5", 5)
    assert v.live == [3, 5]


@pytest.mark.parametrize("stale", [5, 4, 0])
def test_versions_only_grow(stale: int) -> None:
    v = AdapterVersions("policy", 2)
    v.publish(5)
    with pytest.raises(ValueError, match="not newer"):
        v.publish(stale)
    assert v.active == Lease("policy-v5", 5) and v.live == [5], "a refused publish changes nothing"


def test_expired_is_everything_outside_the_window_oldest_first() -> None:
    v = AdapterVersions("policy", 2)
    for step in (1, 2):
        v.publish(step)
    assert v.expired() == []
    v.publish(3)
    assert v.expired() == [Lease("policy-v1", 1)]
    v.publish(4)
    assert v.expired() == [Lease("policy-v1", 1), Lease("policy-v2", 2)]
    v.mark_retired(1)
    assert v.live == [2, 3, 4] and v.expired() == [Lease("policy-v2", 2)]


def test_recently_used_retention_keeps_the_versions_last_held_and_always_the_active_one() -> None:
    v = AdapterVersions("slot0", 2, recently_used=True)
    for step in (1, 2, 3):
        v.publish(step)
    assert v.expired() == [Lease("slot0-v1", 1)]  # nothing held yet: the oldest publish goes first
    with v.hold(1):  # a sampling client still samples version 1
        pass
    assert v.expired() == [Lease("slot0-v2", 2)]
    v.publish(4)  # 4 active, 1 held last: 2 and 3 least recently used
    assert v.expired() == [Lease("slot0-v2", 2), Lease("slot0-v3", 3)]
    for step in (1, 2, 3):
        with v.hold(step):
            pass
    assert 4 not in [lease.version for lease in v.expired()], "the active version is never retired"
    assert v.expired() == [Lease("slot0-v1", 1), Lease("slot0-v2", 2)]
    v.mark_retired(1)
    with pytest.raises(KeyError):
        with v.hold(1):
            pass


def test_lease_pins_the_version_that_was_active_when_taken() -> None:
    v = AdapterVersions("policy", 2)
    v.publish(1)
    with v.lease() as first:
        assert first == Lease("policy-v1", 1)
        assert v.in_flight(1) == 1
        with v.lease():
            assert v.in_flight(1) == 2
        v.publish(2)  # a new version arrives while the request runs
        assert first.version == 1 and v.in_flight(1) == 1 and v.in_flight(2) == 0
        with v.lease() as second:
            assert second == Lease("policy-v2", 2)
    assert v.in_flight(1) == 0 and v.in_flight(2) == 0


def test_lease_is_released_when_the_request_fails() -> None:
    v = AdapterVersions("policy", 2)
    v.publish(1)
    with pytest.raises(KeyError):
        with v.lease():
            raise KeyError("engine error")
    assert v.in_flight(1) == 0


def test_wait_drained_blocks_until_the_last_lease_is_released() -> None:
    v = AdapterVersions("policy", 2)
    v.publish(1)
    t, release = hold_lease(v)
    started = time.monotonic()
    assert v.wait_drained(1, 0.2) is False
    assert 0.15 <= time.monotonic() - started < 2.0, "a timed-out wait takes about its timeout"
    threading.Timer(0.1, release.set).start()
    assert v.wait_drained(1, 5.0) is True
    t.join(5)
    assert v.wait_drained(2, 0.0) is True, "a version nobody leased is drained"


def test_the_active_version_cannot_be_retired() -> None:
    v = AdapterVersions("policy", 1)
    v.publish(1)
    v.publish(2)
    with pytest.raises(ValueError, match="active"):
        v.mark_retired(2)
    assert v.live == [1, 2]
    v.mark_retired(1)
    assert v.live == [2] and v.active == Lease("policy-v2", 2)
    v.mark_retired(1)  # retiring twice is harmless
    assert v.live == [2]


def test_forget_all_after_an_engine_restart() -> None:
    v = AdapterVersions("policy", 2)
    v.publish(1)
    v.publish(2)
    v.forget_all()
    assert v.active is None and v.live == [] and v.expired() == []
    assert v.publish(3) == "policy-v3"
    assert v.live == [3]


def test_a_lease_held_across_forget_all_is_released_cleanly() -> None:
    # The engine restarts (forget_all) while a rollout holds a lease; that rollout then ends
    # (usually with an engine error). Leaving the lease must not raise a second, unrelated error.
    v = AdapterVersions("policy", 2)
    v.publish(1)
    with v.lease():
        v.forget_all()
    assert v.in_flight(1) == 0


def test_a_lease_from_before_a_restart_ending_first_keeps_the_new_lease_counted() -> None:
    v = AdapterVersions("policy", 2)
    v.publish(1)
    old = v.lease()
    old.__enter__()
    v.forget_all()
    v.publish(1)
    with v.lease():
        old.__exit__(None, None, None)  # the pre-restart rollout ends while the new one runs
        assert v.in_flight(1) == 1, "the new request still pins version 1"
        assert not v.wait_drained(1, 0.05)
    assert v.in_flight(1) == 0


def test_a_stale_publish_says_that_versions_are_steps() -> None:
    v = AdapterVersions("policy", 2)
    v.publish(5)
    with pytest.raises(ValueError) as err:
        v.publish(5)
    assert str(err.value) == ("adapter version 5 is not newer than the active 5; versions are training steps "
                              "and must grow")
