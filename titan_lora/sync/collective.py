"""Rank 0 decides, every rank learns: the two small collectives the syncer's control flow rests on.

Only rank 0 talks to the engine. If it raised alone, the other ranks would wait in the next
collective until the process-group timeout and the user would see that instead of the real error.
So every outcome of rank 0's work is broadcast, and every rank acts on it the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from titan_lora.transfer.errors import TransferError

T = TypeVar("T")


class RankZeroError(TransferError):
    """Rank 0's work failed; raised on every rank. `cause` is the original error (rank 0 only)."""

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause


def share(value: Any) -> Any:
    """Collective: rank 0's `value` on every rank (picklable)."""
    box = [value]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def on_rank0(fn: Callable[[], T] | None, then: Callable[[], None] | None = None,
             share_value: bool = False) -> T | None:
    """Collective: rank 0 runs `fn` (None elsewhere), every rank runs `then`, and a failure of `fn`
    raises RankZeroError on every rank. Returns fn's value on rank 0, None elsewhere; with `share_value`,
    on every rank, in the same one broadcast as the outcome (the value must pickle)."""
    value, failure = None, None
    if fn is not None:
        try:
            value = fn()
        except Exception as err:  # noqa: BLE001 (shared, then raised on every rank)
            failure = err
    if then is not None:
        then()
    message = None if failure is None else f"{type(failure).__name__}: {failure}"
    if share_value:
        message, value = share((message, value if failure is None else None))
    else:
        message = share(message)
    if message is None:
        return value
    raise RankZeroError(message, cause=failure)
