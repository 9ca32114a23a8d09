"""One mixed step: the forward/forward_backward requests of several clients, each on its own adapter slot, in one
forward over all their datums (rows grouped by slot) and one backward.

Gradients accumulate in each slot's parameters until that client's `optim_step`, as Tinker's
`forward_backward` calls accumulate. A request whose datums are wrong (tokens outside the vocabulary, a
sequence over the model's length, loss inputs of the wrong shape, an unknown loss) is refused before the
forward and changes nothing; the others of the step go on.

On several ranks every rank is given the same requests and runs its own share of the rows (the service's
rounds, `rounds.py`); FSDP sums the ranks' gradients, so the step is the one-rank step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from titan_lora.lora.multi_rows import group_rows, route
from titan_lora.rl.logprobs import routed_token_logprobs
from titan_lora.service.losses import LossInputError, check_loss, datum_loss
from titan_lora.service.wire import Datum, ForwardBackward
from titan_lora.trainer.host_memory import release_freed_host_memory


@dataclass(frozen=True)
class Limits:
    """What one request may carry."""

    vocab_size: int
    max_seq_len: int
    max_request_tokens: int
    micro_batch_tokens: int = 1024
    """Padded tokens one forward and backward of a step covers (a longer datum runs alone)."""


@dataclass
class Work:
    """One client's request in a mixed step, on its slot."""

    slot: int
    request: ForwardBackward


@dataclass
class Outcome:
    """A request's result: each datum's target log-probs and `loss:sum`, or why it was refused."""

    logprobs: list[np.ndarray] | None = None
    metrics: dict[str, float] | None = None
    error: str | None = None


def request_error(request: ForwardBackward, limits: Limits) -> str | None:
    """Why `request` cannot run (None: it can)."""
    if not request.data:
        return "the request has no datums"
    total = sum(len(d.tokens) for d in request.data)
    if total > limits.max_request_tokens:
        return (f"the request carries {total} tokens; [service] max_request_tokens is "
                f"{limits.max_request_tokens}: send fewer datums per call")
    for i, datum in enumerate(request.data):
        n = len(datum.tokens)
        if n == 0 or n > limits.max_seq_len:
            return f"datum {i} has {n} tokens; the model takes 1 to {limits.max_seq_len}"
        for key, tokens in (("model_input", datum.tokens), ("target_tokens", datum.inputs.get("target_tokens"))):
            if tokens is not None and tokens.size and (tokens.min() < 0 or tokens.max() >= limits.vocab_size):
                return (f"datum {i}: {key} holds token id {int(tokens.max() if tokens.max() >= 0 else tokens.min())}"
                        f" outside the vocabulary [0, {limits.vocab_size})")
        try:
            check_loss(request.loss_fn, datum.inputs, n, i)
        except LossInputError as err:
            return str(err)
    return None


def run_step(model: nn.Module, works: Sequence[Work], slots: int, limits: Limits, device: torch.device,
             group: dist.ProcessGroup | None = None) -> list[Outcome]:
    """Collective under FSDP: every valid request's datums, grouped by slot, in forwards (and backwards, if any
    request trains) of at most `limits.micro_batch_tokens` padded tokens each; one outcome per work, in order,
    on every rank. With a data-parallel `group`, every rank is given the same works and takes its own share of
    the rows (FSDP sums the ranks' gradients)."""
    outcomes = [Outcome(error=request_error(w.request, limits)) for w in works]
    valid = [i for i, o in enumerate(outcomes) if o.error is None]
    rows = [(i, datum) for i in valid for datum in works[i].request.data]
    if not rows:
        return outcomes
    order, _ = group_rows([works[i].slot for i, _ in rows], slots)
    ordered = [rows[j] for j in order.tolist()]
    rank, size = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    share = -(-len(ordered) // size)
    batches = micro_batches(list(enumerate(ordered))[rank * share:(rank + 1) * share], limits.micro_batch_tokens)
    count = torch.tensor(len(batches), device=device)
    if group is not None:  # every rank runs as many forwards and backwards (FSDP's are collective)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    trains = any(not works[i].request.forward_only for i in valid)
    logprobs: dict[int, np.ndarray] = {}
    losses = {i: 0.0 for i in valid}
    try:
        for batch in batches + [[]] * (int(count) - len(batches)):  # [] runs one padding row
            _run_rows(model, works, batch, slots, device, trains, logprobs, losses)
    finally:
        route(model, None)
    release_freed_host_memory()  # a step's activations are gone: give their pages back (CPU)
    if group is not None:  # every rank ends with every row's log-probs and every request's loss
        shared: list = [None] * size
        dist.all_gather_object(shared, (logprobs, losses), group=group)
        logprobs = {r: lp for part, _ in shared for r, lp in part.items()}
        losses = {i: sum(part[i] for _, part in shared) for i in valid}
    by_datum: dict[int, dict[int, np.ndarray]] = {i: {} for i in valid}  # work -> id(datum) -> its log-probs
    for r, (i, datum) in enumerate(ordered):
        by_datum[i][id(datum)] = logprobs[r]
    for i in valid:
        outcomes[i] = Outcome(logprobs=[by_datum[i][id(d)] for d in works[i].request.data],
                              metrics={"loss:sum": losses[i]})
    return outcomes


Row = tuple[int, tuple[int, Datum]]
"""A row of a step: its index in the step, and (its work, its datum)."""


def micro_batches(rows: list[Row], max_tokens: int) -> list[list[Row]]:
    """`rows` cut in order into runs of at most `max_tokens` padded tokens (rows x the longest), one row at
    least each."""
    batches: list[list[Row]] = []
    width = 0
    for row in rows:
        n = len(row[1][1].tokens)
        if batches and (len(batches[-1]) + 1) * max(width, n) <= max_tokens:
            batches[-1].append(row)
            width = max(width, n)
        else:
            batches.append([row])
            width = n
    return batches


def _run_rows(model: nn.Module, works: Sequence[Work], rows: list[Row], slots: int, device: torch.device,
              trains: bool, logprobs: dict[int, np.ndarray], losses: dict[int, float]) -> None:
    """One forward of `rows` (sorted by slot; none: one masked padding row) and, with `trains`, one backward;
    each row's log-probs into `logprobs`, each work's loss added into `losses`."""
    _, segments = group_rows([works[i].slot for _, (i, _) in rows] or [0], slots)  # rows come sorted by slot
    width = max([len(d.tokens) for _, (_, d) in rows] or [1])
    tokens = torch.zeros(max(len(rows), 1), width, dtype=torch.int64)
    labels = torch.zeros_like(tokens)
    mask = torch.zeros(tokens.shape, dtype=torch.bool)
    for r, (_, (_, datum)) in enumerate(rows):
        n = len(datum.tokens)
        tokens[r, :n] = torch.from_numpy(datum.tokens)
        labels[r, :n] = torch.from_numpy(datum.inputs["target_tokens"].astype(np.int64))
        mask[r, :n] = True
    tokens, labels, mask = tokens.to(device), labels.to(device), mask.to(device)
    with torch.set_grad_enabled(trains):
        logp = routed_token_logprobs(model, segments, tokens, labels, mask)
        total = None
        for r, (index, (i, datum)) in enumerate(rows):
            n = len(datum.tokens)
            request = works[i].request
            inputs = {k: torch.as_tensor(v, device=device).float() for k, v in datum.inputs.items()
                      if k != "target_tokens"}
            loss = datum_loss(request.loss_fn, logp[r, :n], inputs, request.config)
            losses[i] += float(loss.detach())
            logprobs[index] = logp[r, :n].detach().float().cpu().numpy()
            if not request.forward_only:
                total = loss if total is None else total + loss
        if trains:  # every rank runs the backward, with rows to train or none: FSDP's is collective
            (torch.where(mask, logp, 0.0).sum() * 0.0 if total is None else total).backward()
