"""torchtitan 0.3.0's optimizers and LR schedulers (from `[optimizer]`, `[lr_scheduler]`), its gradient
clipping and its summed cross-entropy.

Part of the seam (`titan_lora.titan`): 0.3.0 builds optimizers and schedulers from their config objects
(`config.build(...)`) and describes `[optimizer]` as parameter groups (`configs.titan_optimizer`: one group,
every trainable parameter).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
from torchtitan.distributed.utils import clip_grad_norm_

from titan_lora.titan.configs import titan_lr_scheduler, titan_optimizer

__all__ = ["build_loss", "build_lr_schedulers", "build_optimizers", "clip_grad_norm_"]


def build_optimizers(model: nn.Module, job_config, groups: Sequence[tuple[str, dict]] = ()) -> OptimizersContainer:  # noqa: ANN001
    """`[optimizer]` over `model`'s trainable params, or one param group per (parameter-name pattern, keys) of
    `groups` (no parallel dims: 0.3.0 reads them only for MoE load balancing, and titan_lora's families are
    dense)."""
    return titan_optimizer(job_config.optimizer, groups).build(model_parts=[model])


def build_lr_schedulers(optimizers: OptimizersContainer, job_config) -> LRSchedulersContainer:  # noqa: ANN001
    """`[lr_scheduler]` over `[training] steps`."""
    return titan_lr_scheduler(job_config.lr_scheduler).build(optimizers=optimizers,
                                                             training_steps=job_config.training.steps)


def build_loss() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """torchtitan's summed token cross-entropy (eager: `[compile] components` is ["model"] only)."""
    loss = CrossEntropyLoss(CrossEntropyLoss.Config())
    return lambda logits, labels: loss(logits, labels)[0]
