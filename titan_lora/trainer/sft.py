"""The supervised objective: next-token loss on completion tokens, identical for any DP degree."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from titan_lora.titan.parallel import DataParallelInfo
from titan_lora.trainer.sft_data import SFTData


def masked_token_nll_sum(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of -log p(label) over positions where mask is 1."""
    nll = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    return (nll * mask.flatten()).sum()


class SFTObjective:
    """Loss of one step: this rank's share of the global batch, normalised by the global token count."""

    def __init__(self, data: SFTData, dp: DataParallelInfo, device: torch.device) -> None:
        self.data = data
        self.dp = dp
        self.device = device

    def before_training(self, step: int) -> None:
        """Nothing: the loop has already synced the engine."""

    def loss(self, model: nn.Module, step: int) -> tuple[torch.Tensor, dict[str, float]]:
        """(loss to backpropagate, metrics) for global batch `step`."""
        batch = self.data.local_batch(step, self.dp.rank, self.dp.size)
        tokens, labels, mask = (t.to(self.device) for t in (batch.tokens, batch.labels, batch.mask))
        local_sum = masked_token_nll_sum(model(tokens), labels, mask)
        counts = torch.stack([local_sum.detach(), mask.sum()])
        if self.dp.group is not None:
            dist.all_reduce(counts, group=self.dp.group)
        global_sum, global_tokens = counts.tolist()
        # torchtitan's FSDP sums gradients over DP ranks (divide factor 1), so dividing each rank's
        # sum by the global token count gives exactly the 1-rank gradient.
        loss = local_sum / global_tokens
        return loss, {"loss": global_sum / global_tokens, "tokens": global_tokens}

    def after_step(self, step: int) -> dict[str, float]:
        """Nothing beyond the loss: the loop logs the sync."""
        return {}

    def progress_fields(self, metrics: dict[str, float]) -> dict[str, str]:
        """Loss, step time and, with syncing on, the sync time."""
        fields = {"loss": f"{metrics['loss']:.4f}", "step_s": f"{metrics['step_time_s']:.2f}"}
        if "sync/total_ms" in metrics:
            fields["sync_ms"] = f"{metrics['sync/total_ms']:.1f}"
        if "sync/probe_ms" in metrics:  # the parity probe's share of sync_ms, on the steps that run it
            fields["probe_ms"] = f"{metrics['sync/probe_ms']:.1f}"
        return fields

    def data_state(self) -> dict | None:
        """None: the SFT data position is the step."""
        return None

    def close(self) -> None:
        """Nothing to release."""
