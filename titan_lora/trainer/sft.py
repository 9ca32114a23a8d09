"""The supervised objective: next-token loss on completion tokens, identical for any DP degree; with several
adapters, each adapter's own rows and loss in one batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from titan_lora.lora.multi_rows import AdapterRows, route
from titan_lora.titan.parallel import DataParallelInfo
from titan_lora.trainer.sft_data import Batch, SFTData


def masked_token_nll_sum(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of -log p(label) over positions where mask is 1."""
    nll = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    return (nll * mask.flatten()).sum()


def stacked(batches: Sequence[Batch], pad_id: int) -> Batch:
    """The batches' rows in order, right-padded to the widest (a padded position has mask 0, and a causal
    model's earlier positions do not see it)."""
    width = max(b.tokens.shape[1] for b in batches)

    def pad(t: torch.Tensor, value: float) -> torch.Tensor:
        return F.pad(t, (0, width - t.shape[1]), value=value)

    return Batch(torch.cat([pad(b.tokens, pad_id) for b in batches]), torch.cat([pad(b.labels, pad_id) for b in batches]),
                 torch.cat([pad(b.mask, 0.0) for b in batches]))


class SFTObjective:
    """Loss of one step: this rank's share of the global batch, normalised by the global token count.

    With several adapters (`names`, one `SFTData` each, in adapter order), each draws its own global batch from
    its own data, the rows go through the model in one batch, grouped by adapter (`multi_rows.route`: the
    training loop unroutes after the backward), and the loss is the sum of each adapter's own normalised loss,
    so every adapter's gradient is the one its own one-adapter job would get."""

    def __init__(self, data: SFTData | Sequence[SFTData], dp: DataParallelInfo, device: torch.device,
                 names: Sequence[str] = ()) -> None:
        self.data = [data] if isinstance(data, SFTData) else list(data)
        if names and len(names) != len(self.data):
            raise ValueError(f"{len(names)} adapter names for {len(self.data)} datasets: one dataset per adapter")
        self.names = list(names)
        self.dp = dp
        self.device = device

    def before_training(self, step: int) -> None:
        """Nothing: the loop has already synced the engine."""

    def loss(self, model: nn.Module, step: int) -> tuple[torch.Tensor, dict[str, float]]:
        """(loss to backpropagate, metrics) for global batch `step`."""
        batches = [d.local_batch(step, self.dp.rank, self.dp.size) for d in self.data]
        batch = stacked(batches, self.data[0].pad_id) if len(batches) > 1 else batches[0]
        tokens, labels, mask = (t.to(self.device) for t in (batch.tokens, batch.labels, batch.mask))
        rows = AdapterRows(tuple(len(b.tokens) for b in batches))
        if self.names:
            route(model, rows)
        logits = model(tokens)
        local = torch.stack([masked_token_nll_sum(logits[lo:hi], labels[lo:hi], mask[lo:hi])
                             for lo, hi in zip(rows.offsets, rows.offsets[1:])])
        counts = torch.cat([local.detach(), torch.stack([mask[lo:hi].sum()
                                                         for lo, hi in zip(rows.offsets, rows.offsets[1:])])])
        if self.dp.group is not None:
            dist.all_reduce(counts, group=self.dp.group)
        global_sums, global_tokens = counts.view(2, -1).tolist()
        # torchtitan's FSDP sums gradients over DP ranks (divide factor 1), so dividing each rank's
        # sum by the global token count gives exactly the 1-rank gradient (each adapter's by its own).
        loss = sum(local[k] / global_tokens[k] for k in range(len(batches)))
        metrics = {"loss": sum(global_sums) / sum(global_tokens), "tokens": sum(global_tokens)}
        for name, total, n in zip(self.names, global_sums, global_tokens):
            metrics[f"{name}/loss"] = total / n
        return loss, metrics
    def after_step(self, step: int) -> dict[str, float]:
        """Nothing beyond the loss: the loop logs the sync."""
        return {}

    def progress_fields(self, metrics: dict[str, float]) -> dict[str, str]:
        """Loss (and each adapter's), step time and, with syncing on, the sync time."""
        fields = {"loss": f"{metrics['loss']:.4f}"}
        fields |= {f"{name}.loss": f"{metrics[f'{name}/loss']:.4f}" for name in self.names}
        fields["step_s"] = f"{metrics['step_time_s']:.2f}"
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
