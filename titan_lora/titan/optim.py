"""torchtitan's optimizers and LR schedulers (built by a train spec from `[optimizer]`, `[lr_scheduler]`) and
its gradient clipping.

Part of the seam (`titan_lora.titan`): 0.3.0 builds both from their config objects (`config.optimizer.build`)
and describes `[optimizer]` as parameter groups.
"""

from __future__ import annotations

import torch.nn as nn
from torchtitan.components.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.utils import clip_grad_norm_
from torchtitan.protocols.train_spec import TrainSpec

from titan_lora.titan.configs import titan_lr_scheduler, titan_optimizer

__all__ = ["build_lr_schedulers", "build_optimizers", "clip_grad_norm_"]


def build_optimizers(spec: TrainSpec, model: nn.Module, job_config,  # noqa: ANN001
                     parallel_dims: ParallelDims) -> OptimizersContainer:
    """`[optimizer]` over `model`'s trainable params, as the train spec builds it."""
    return spec.build_optimizers_fn([model], titan_optimizer(job_config.optimizer), parallel_dims)


def build_lr_schedulers(spec: TrainSpec, optimizers: OptimizersContainer,
                        job_config) -> LRSchedulersContainer:  # noqa: ANN001
    """`[lr_scheduler]` over `[training] steps`, as the train spec builds it."""
    return spec.build_lr_schedulers_fn(optimizers, titan_lr_scheduler(job_config.lr_scheduler),
                                      job_config.training.steps)
