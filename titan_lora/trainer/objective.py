"""The training objective protocol (the composition root picks GRPO or SFT)."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn as nn


class Objective(Protocol):
    """What the training loop asks of an objective."""

    def before_training(self, step: int) -> None:
        """Work before the first step `step + 1`, after the engine got the adapter (e.g. a base eval)."""
        ...

    def loss(self, model: nn.Module, step: int) -> tuple[torch.Tensor, dict[str, float]]:
        """(loss to backpropagate, metrics) for `step`."""
        ...

    def after_step(self, step: int) -> dict[str, float]:
        """Metrics gathered after the optimizer step and its sync (e.g. evaluation)."""
        ...

    def progress_fields(self, metrics: dict[str, float]) -> dict[str, str]:
        """The few figures the progress line shows."""
        ...

    def data_state(self) -> dict | None:
        """Rank 0: the data position a checkpoint keeps beside the step, JSON-able (None: the step is it)."""
        ...

    def close(self) -> None:
        """Release engines and threads."""
        ...

