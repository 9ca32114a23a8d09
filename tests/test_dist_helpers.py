"""The multi-rank harness itself: a failed rank fails the test at once, not when its peers time out."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from dist_helpers import run_ranks


def _rank0_fails_while_rank1_waits(rank: int, world: int) -> None:
    if rank == 0:
        raise ValueError("rank 0's assertion")
    time.sleep(600)  # as a peer blocked in a collective that rank 0 will never join


def test_a_failed_rank_fails_the_test_and_its_waiting_peer_is_stopped() -> None:
    started = time.monotonic()
    with pytest.raises(AssertionError, match="(?s)rank 0:.*ValueError: rank 0's assertion"):
        run_ranks(2, _rank0_fails_while_rank1_waits)
    assert time.monotonic() - started < 60, "reported after the grace period, not the 900 s timeout"


def _quiet(rank: int, world: int) -> None:
    pass


def _report(rank: int, world: int, name: str) -> None:
    # One write per line (print's own "\n" is a second write): the two ranks' lines must not interleave.
    print(f"rank {rank} stdout\n", end="", flush=True)
    os.write(2, f"rank {rank} stderr {os.environ.get(name)} {os.getcwd()}\n".encode())


def test_a_rank_starts_from_the_callers_environment_directory_and_output_at_the_call(
        capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Ranks fork from a server that the first call starts: here, outside this test's capture and before
    # the variable and the directory change, as an earlier test would have.
    with capfd.disabled():
        run_ranks(2, _quiet)
    monkeypatch.setenv("TITAN_LORA_TEST_RANK_ENV", "set-after-the-server")
    monkeypatch.chdir(tmp_path)
    run_ranks(2, _report, "TITAN_LORA_TEST_RANK_ENV")
    out, err = capfd.readouterr()
    assert sorted(out.splitlines()) == ["rank 0 stdout", "rank 1 stdout"]
    assert sorted(err.splitlines()) == [f"rank {r} stderr set-after-the-server {tmp_path}" for r in (0, 1)]
