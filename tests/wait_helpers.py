"""Polling with a deadline, for tests that wait on another thread or process."""

from __future__ import annotations

import time
from collections.abc import Callable


def waited(condition: Callable[[], object], timeout_s: float = 10.0, poll_s: float = 0.02) -> bool:
    """Poll `condition` until it is true (True) or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True
