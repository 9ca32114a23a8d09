"""Rank 0 decides, every rank learns: the two small collectives the syncer's control flow rests on.

Only rank 0 talks to the engine. If it raised alone, the other ranks would wait in the next
collective until the process-group timeout and the user would see that instead of the real error.
So every outcome of rank 0's work is broadcast, and every rank acts on it the same way.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from titan_lora.transfer.errors import TransferError

T = TypeVar("T")


class RankZeroError(TransferError):
    """Rank 0's work failed; raised on every rank. `cause` is the original error (rank 0 only)."""

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause


SHARE_BOX_BYTES = 4096
"""A control message up to this size, pickled, goes in one broadcast of a fixed-size buffer."""
_LENGTH_BYTES = 8


def _box_device() -> torch.device:
    """Where the default group's broadcast takes its tensors: the host for gloo, this rank's GPU for NCCL."""
    if "gloo" in dist.get_backend():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def share(value: Any) -> Any:
    """Collective: rank 0's `value` on every rank (picklable).

    One broadcast of a fixed-size buffer, where `broadcast_object_list` makes two (sizes, then bytes)
    with a host copy around each: the syncer sends one such message every sync. A value that does not
    fit the buffer follows by `broadcast_object_list`.
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    box = torch.empty(SHARE_BOX_BYTES, dtype=torch.uint8, device=_box_device())  # read up to its length
    rank0 = dist.get_rank() == 0
    if rank0:
        data = pickle.dumps(value)
        fits = len(data) <= SHARE_BOX_BYTES - _LENGTH_BYTES
        head = len(data).to_bytes(_LENGTH_BYTES, "little") + (data if fits else b"")
        box[: len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
    dist.broadcast(box, src=0)
    if rank0:
        received = value
    else:
        raw = box.cpu().numpy().tobytes()
        length = int.from_bytes(raw[:_LENGTH_BYTES], "little")
        fits = length <= SHARE_BOX_BYTES - _LENGTH_BYTES
        received = pickle.loads(raw[_LENGTH_BYTES : _LENGTH_BYTES + length]) if fits else None
    if not fits:
        out = [received]
        dist.broadcast_object_list(out, src=0)
        received = out[0]
    return received


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
