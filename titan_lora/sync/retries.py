"""Retries of rank 0's engine calls: capped back-off, and no retry where one cannot help (every rank-0 wait
is bounded, `config.rank0_wait_budget_s`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from titan_lora.config import BACKOFF_CAP_S
from titan_lora.transfer.errors import EngineDied, EngineUnreachable, EngineWeightsLost, TransferError

logger = logging.getLogger("titan_lora.sync.syncer")
T = TypeVar("T")


def backoff(attempt: int) -> None:
    """Sleep before retry `attempt + 1`: 1, 2, 4, ... seconds, capped at BACKOFF_CAP_S."""
    time.sleep(min(2.0**attempt, BACKOFF_CAP_S))


def with_retries(fn: Callable[[], T], retries: int, what: str, alive: Callable[[], bool] | None = None) -> T:
    """Call `fn`, retrying on TransferError with capped back-off; engine faults that a retry cannot mend
    (weights lost, or `alive()` False: a dead or hung embedded engine) are re-raised at once."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except (EngineWeightsLost, EngineDied):
            raise
        except TransferError as err:
            if alive is not None and not alive():
                raise EngineDied(f"{what}: the engine is dead or hung ({err})") from err
            if attempt == retries:  # an engine fault stays one: the syncer recovers from those
                kind = type(err) if isinstance(err, EngineUnreachable) else TransferError
                raise kind(f"{what} failed after {retries + 1} attempts: {err}") from err
            logger.warning("%s failed (%s); retrying", what, err)
            backoff(attempt)
    raise AssertionError("unreachable")
