"""The multi-rank harness itself: a failed rank fails the test at once, not when its peers time out."""

from __future__ import annotations

import time

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
