"""The parity probe: trainer vs engine log-probs of a fixed batch under the version just published."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_lora.lora.multi_rows import AdapterRows, routed

logger = logging.getLogger(__name__)


@torch.no_grad()
def trainer_logprobs(model: nn.Module, sequences: list[list[int]], device: torch.device,
                     rows: AdapterRows | None = None) -> list[list[float]]:
    """Collective under FSDP: log p(token t | < t) for every token after the first, per sequence; `rows`: in a
    model with several adapters, which one each row runs under."""
    width = max(len(s) for s in sequences)
    tokens = torch.zeros(len(sequences), width, dtype=torch.long)
    for i, s in enumerate(sequences):
        tokens[i, : len(s)] = torch.tensor(s)
    was_training = model.training
    model.eval()
    if rows is None:
        logits = model(tokens.to(device)).float()
    else:
        with routed(model, rows):
            logits = model(tokens.to(device)).float()
    model.train(was_training)
    logp = F.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None].to(device)).squeeze(-1)
    return [logp[i, : len(s) - 1].tolist() for i, s in enumerate(sequences)]


class ParityProbe:
    """Compares the engine's log-probs under an adapter with the trainer's; rank 0 reports."""

    def __init__(self, model: nn.Module, sequences: list[list[int]], device: torch.device,
                 score: Callable[[list[list[int]], str], list[list[float]]] | None, tolerance: float) -> None:
        self.model = model
        self.sequences = sequences
        self.device = device
        self.score = score  # rank 0 only
        self.tolerance = tolerance
        self.violations: collections.Counter[str] = collections.Counter()  # per family of versions

    def trainer_side(self, adapter: int | None = None, adapters: int = 1) -> list[list[float]]:
        """Collective (a forward under FSDP): the trainer's log-probs of the fixed batch; in a model with
        `adapters` adapters, every row under adapter `adapter`."""
        rows = None if adapter is None else AdapterRows(tuple(len(self.sequences) * (k == adapter)
                                                               for k in range(adapters)))
        return trainer_logprobs(self.model, self.sequences, self.device, rows)

    def compare(self, ours: list[list[float]], adapter: str, family: str = "") -> dict[str, float]:
        """Rank 0: the engine's log-probs under `adapter` against ours; a violation is logged with figures and
        counted for `family` (the adapter's, in a job with several)."""
        if self.score is None or not adapter:
            return {}
        theirs = self.score(self.sequences, adapter)
        diffs = torch.tensor([abs(a - b) for x, y in zip(ours, theirs, strict=True)
                              for a, b in zip(x, y, strict=True)])
        worst, mean = float(diffs.max()), float(diffs.mean())
        if worst > self.tolerance:
            self.violations[family] += 1
            logger.warning("parity probe on %s: max |trainer - engine| log-prob %.3g > [weight_sync] "
                           "parity_tolerance %.3g (mean %.3g over %d tokens)", adapter, worst, self.tolerance,
                           mean, diffs.numel())
        return {"parity_max_abs": worst, "parity_mean_abs": mean, "parity_violations": self.violations[family]}
