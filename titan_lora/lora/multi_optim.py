"""Per-adapter optimizer state, learning rate and gradient clipping for K adapters trained in one model.

One optimizer param group per adapter carries its own lr (torch's `LambdaLR` takes one schedule per group, so
each adapter keeps its own schedule); Adam's state and step count are per parameter, hence per adapter. Each
adapter's gradients are clipped by its own norm, so one adapter's large gradient never scales another's
update (one norm over all adapters would). An adapter whose norm is not finite has its gradients dropped:
the optimizer skips parameters without a gradient, so it alone does not step and the others step as usual.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch.nn as nn

from titan_lora.titan.optim import clip_grad_norm_

logger = logging.getLogger(__name__)


def adapter_param_groups(params: Sequence[Sequence[tuple[str, nn.Parameter]]],
                         lrs: Sequence[float]) -> list[dict]:
    """One optimizer param group per adapter (`multi.params_by_adapter`'s lists), with that adapter's lr."""
    if len(params) != len(lrs):
        raise ValueError(f"{len(lrs)} learning rates for {len(params)} adapters: give one lr per adapter")
    return [{"params": [p for _, p in group], "param_names": [n for n, _ in group], "lr": lr, "adapter": k}
            for k, (group, lr) in enumerate(zip(params, lrs))]


@dataclass(frozen=True)
class AdapterNorms:
    """Each adapter's gradient norm before clipping; the adapters whose norm was not finite did not step."""

    norms: tuple[float, ...]

    @property
    def nonfinite(self) -> tuple[int, ...]:
        """The adapters whose gradient held NaN/Inf: their gradients were dropped."""
        return tuple(k for k, norm in enumerate(self.norms) if not math.isfinite(norm))


def clip_per_adapter(param_groups: Sequence[dict], max_norm: float) -> AdapterNorms:
    """Collective under FSDP/TP: clip each adapter's gradients to `max_norm` by its own total norm, and drop
    the gradients of an adapter whose norm is NaN/Inf (logged by adapter), so `optimizer.step()` skips it."""
    norms = []
    for group in param_groups:
        norm = float(clip_grad_norm_(group["params"], max_norm, foreach=True))
        if not math.isfinite(norm):
            for param in group["params"]:
                param.grad = None
            logger.error("adapter %d: gradient norm %s; its gradients are dropped and it skips this step, "
                         "the other adapters step", group["adapter"], norm)
        norms.append(norm)
    return AdapterNorms(tuple(norms))
