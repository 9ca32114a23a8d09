"""The training objective protocol and its selection (`[grpo] enabled` picks GRPO, else SFT)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from titan_lora.train import TrainingRun


class Objective(Protocol):
    """What the training loop asks of an objective."""

    def before_training(self, step: int) -> None:
        """Work before the first step `step + 1` (e.g. push the adapter, measure the base accuracy)."""
        ...

    def loss(self, model: nn.Module, step: int) -> tuple[torch.Tensor, dict[str, float]]:
        """(loss to backpropagate, metrics) for `step`."""
        ...

    def after_step(self, step: int) -> dict[str, float]:
        """Metrics gathered after the optimizer step (evaluation, sync)."""
        ...

    def progress_fields(self, metrics: dict[str, float]) -> dict[str, str]:
        """The few figures the progress line shows."""
        ...

    def close(self) -> None:
        """Release engines and threads."""
        ...


def build_objective(run: TrainingRun) -> Objective:
    """The objective the job config asks for."""
    from titan_lora.trainer.sft import SFTObjective
    from titan_lora.trainer.sft_data import SFTData
    from titan_lora.trainer.parallel import data_parallel_info

    from transformers import AutoTokenizer

    cfg = run.cfg
    tokenizer = AutoTokenizer.from_pretrained(run.built.hf_dir)
    dp = data_parallel_info(run.dims)
    if cfg.grpo.enabled:
        from titan_lora.rl.objective import GRPOObjective

        return GRPOObjective(cfg.grpo, tokenizer, run.syncer, dp, run.device, run.metrics)
    global_batch = cfg.training.global_batch_size
    if global_batch <= 0:
        global_batch = cfg.training.local_batch_size * dp.size
    data = SFTData(tokenizer, cfg.data.path, cfg.training.seq_len, global_batch, cfg.data.seed)
    return SFTObjective(data, dp, run.device, run.syncer)
