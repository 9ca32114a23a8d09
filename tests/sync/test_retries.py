"""with_retries: capped back-off (every rank-0 wait is bounded), and no retry where one cannot help."""

from __future__ import annotations

import pytest

from titan_lora.sync.retries import with_retries
from titan_lora.clients.frames import FrameRefused
from titan_lora.transfer.errors import EngineDied, EngineUnreachable, EngineWeightsLost, TransferError


class Failing:
    """Raises `error` on every call and counts the calls."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        raise self.error


def test_back_off_doubles_and_is_capped_at_ten_seconds(sleeps: list[float]) -> None:
    fn = Failing(TransferError("HTTP 500"))
    with pytest.raises(TransferError, match="sending adapter policy-v3 failed after 7 attempts: HTTP 500"):
        with_retries(fn, 6, "sending adapter policy-v3")
    assert fn.calls == 7 and sleeps == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_a_dead_or_hung_engine_is_not_retried(sleeps: list[float]) -> None:
    fn = Failing(TransferError("timed out"))
    with pytest.raises(EngineDied, match="reaching the engine: the engine is dead or hung"):
        with_retries(fn, 3, "reaching the engine", alive=lambda: False)
    assert fn.calls == 1 and sleeps == []


@pytest.mark.parametrize("error", [EngineWeightsLost("no base"), EngineDied("exit code -9")])
def test_faults_that_a_retry_cannot_mend_are_raised_at_once(sleeps: list[float], error: Exception) -> None:
    fn = Failing(error)
    with pytest.raises(type(error)):
        with_retries(fn, 3, "sending adapter policy-v1", alive=lambda: True)
    assert fn.calls == 1 and sleeps == []


def test_a_transient_failure_is_retried_until_it_succeeds(sleeps: list[float]) -> None:
    outcomes = iter([TransferError("reset"), TransferError("reset"), None])

    def flaky() -> str:
        err = next(outcomes)
        if err is not None:
            raise err
        return "ack"

    assert with_retries(flaky, 3, "posting a bucket", alive=lambda: True) == "ack" and sleeps == [1.0, 2.0]


def test_each_retry_is_logged_with_what_failed_and_why(sleeps: list[float], caplog: pytest.LogCaptureFixture) -> None:
    import logging

    outcomes = iter([TransferError("connection reset"), None])

    def flaky() -> str:
        if (err := next(outcomes)) is not None:
            raise err
        return "ack"

    with caplog.at_level(logging.WARNING, logger="titan_lora.sync.syncer"):
        assert with_retries(flaky, 2, "posting bucket 3") == "ack"
    assert [r.getMessage() for r in caplog.records if r.name == "titan_lora.sync.syncer"] == [
        "posting bucket 3 failed (connection reset); retrying"]


@pytest.mark.parametrize("error", [EngineUnreachable("connection refused"), FrameRefused("no greeting")])
def test_an_engine_fault_keeps_its_type_through_the_retries(sleeps: list[float], error: Exception) -> None:
    # A plain TransferError after the last retry would end the run instead of recovering the engine.
    fn = Failing(error)
    with pytest.raises(type(error), match="sending adapter policy-v1 failed after 3 attempts"):
        with_retries(fn, 2, "sending adapter policy-v1", alive=lambda: True)
    assert fn.calls == 3
