"""`titan_lora.train` with one adapter element of rank 0's shard set to NaN after the optimizer step of step
$TITAN_LORA_TEST_NAN_STEP: a NaN step, which no data of the small job causes on cue. torchrun runs this file
in place of `-m titan_lora.train` (tests/rl/test_grpo_async.py); everything else is the real job."""

from __future__ import annotations

import os

import torch
from torch.distributed.tensor import DTensor

from titan_lora import train
from titan_lora.lora.layer import adapter_params

NAN_STEP = int(os.environ["TITAN_LORA_TEST_NAN_STEP"])
_train_step = train.TrainingRun.train_step


def train_step_then_nan(run: train.TrainingRun) -> dict[str, float]:
    """The real step; at NAN_STEP rank 0 then poisons its shard, so only the collective check can see it."""
    metrics = _train_step(run)
    if run.step == NAN_STEP and os.environ.get("RANK") == "0":
        _, param = adapter_params(run.model)[0]
        local = param.to_local() if isinstance(param, DTensor) else param
        with torch.no_grad():
            local[(0,) * local.dim()] = float("nan")
    return metrics


train.TrainingRun.train_step = train_step_then_nan

if __name__ == "__main__":
    train.main()
