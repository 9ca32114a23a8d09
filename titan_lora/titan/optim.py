"""torchtitan's optimizers and LR schedulers (from `[optimizer]`, `[lr_scheduler]`), its gradient clipping and
its cross-entropy loss.

Part of the seam (`titan_lora.titan`): 0.3.0 builds optimizers and schedulers from their config objects
(`config.optimizer.build`) and describes `[optimizer]` as parameter groups.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.lr_scheduler import LRSchedulersContainer
from torchtitan.components.lr_scheduler import build_lr_schedulers as titan_build_lr_schedulers
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer import build_optimizers as titan_build_optimizers
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.utils import clip_grad_norm_

from titan_lora.titan.configs import titan_job_config, titan_lr_scheduler, titan_optimizer

__all__ = ["build_loss", "build_lr_schedulers", "build_optimizers", "clip_grad_norm_"]


def build_optimizers(model: nn.Module, job_config, parallel_dims: ParallelDims) -> OptimizersContainer:  # noqa: ANN001
    """`[optimizer]` over `model`'s trainable params."""
    return titan_build_optimizers([model], titan_optimizer(job_config.optimizer), parallel_dims)


def build_lr_schedulers(optimizers: OptimizersContainer, job_config) -> LRSchedulersContainer:  # noqa: ANN001
    """`[lr_scheduler]` over `[training] steps`."""
    return titan_build_lr_schedulers(optimizers, titan_lr_scheduler(job_config.lr_scheduler),
                                     job_config.training.steps)


def build_loss(job_config) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:  # noqa: ANN001
    """torchtitan's summed token cross-entropy, compiled when `[compile] components` names "loss"."""
    return build_cross_entropy_loss(titan_job_config(job_config))
