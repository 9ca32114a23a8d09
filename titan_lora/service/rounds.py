"""Several trainer ranks under one service: rank 0 takes each round of calls from its ledger and hands that
round to every rank in one broadcast, and each rank runs it on its shard of the model (the mixed step splits
its rows over the data-parallel ranks, `step.run_step`).

A round goes out every second even when it holds no call, so the other ranks wait for the next one inside a
collective that rank 0 reaches soon, never past the process group's timeout. They answer no one: they drop
their futures, and their ledger holds the models rank 0's rounds name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan_lora.service.futures import FutureStore, Result
from titan_lora.service.ledger import Ledger, Model, Op


@dataclass
class Round:
    """One round of calls, and the models they name as rank 0's ledger holds them (without their queues);
    `stop`: the service is ending."""

    ops: list[Op]
    models: dict[str, Model]
    stop: bool = False


def rank0_round(ledger: Ledger, ops: list[Op]) -> Round:
    """The round `ops` make, with their models from rank 0's `ledger`."""
    return Round(ops, {op.model_id: dataclasses.replace(ledger.models[op.model_id], queued={}, requests={})
                       for op in ops if op.model_id in ledger.models})


def share_round(round_: Round | None, device: torch.device) -> Round:
    """Collective: rank 0's `round_` on every rank (the others pass None)."""
    box = [round_]
    dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
    return box[0]


def mirror(ledger: Ledger, round_: Round) -> None:
    """Put the round's models that this rank's `ledger` does not hold yet into it, as rank 0 holds them."""
    for model_id, model in round_.models.items():
        ledger.models.setdefault(model_id, model)


class DroppedFutures(FutureStore):
    """The futures of a rank that answers no one: finishing one keeps nothing."""

    def finish(self, request_id: str, result: Result) -> None:
        """Drop `result`: rank 0 answers the call."""
