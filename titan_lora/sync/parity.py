"""The parity probe: trainer vs engine log-probs of a fixed batch under the version just published."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


@torch.no_grad()
def trainer_logprobs(model: nn.Module, sequences: list[list[int]], device: torch.device) -> list[list[float]]:
    """Collective under FSDP: log p(token t | < t) for every token after the first, per sequence."""
    width = max(len(s) for s in sequences)
    tokens = torch.zeros(len(sequences), width, dtype=torch.long)
    for i, s in enumerate(sequences):
        tokens[i, : len(s)] = torch.tensor(s)
    was_training = model.training
    model.eval()
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
        self.violations = 0

    def __call__(self, adapter: str) -> dict[str, float]:
        """Collective. Rank 0 returns parity_max_abs / parity_mean_abs (others: {})."""
        ours = trainer_logprobs(self.model, self.sequences, self.device)
        if self.score is None or not adapter:
            return {}
        theirs = self.score(self.sequences, adapter)
        diffs = torch.tensor([abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x, y)])
        worst = float(diffs.max())
        self.violations += int(worst > self.tolerance)
        return {"parity_max_abs": worst, "parity_mean_abs": float(diffs.mean()),
                "parity_violations": self.violations}
