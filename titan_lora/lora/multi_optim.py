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


from titan_lora.config_adapters import Adapter
from titan_lora.lora.multi import param_pattern
from titan_lora.titan.optim import clip_grad_norm_

logger = logging.getLogger(__name__)


def adapter_optimizer_groups(adapters: Sequence[Adapter]) -> list[tuple[str, dict]]:
    """(parameter-name pattern, optimizer keys) per adapter, in adapter order: the job's optimizer then has one
    param group per adapter with that adapter's lr, betas, eps and weight decay."""
    return [(param_pattern(k), {"lr": a.lr, "betas": (a.beta1, a.beta2), "eps": a.eps,
                                "weight_decay": a.weight_decay})
            for k, a in enumerate(adapters)]


@dataclass(frozen=True)
class AdapterNorms:
    """Each adapter's gradient norm before clipping; the adapters whose norm was not finite did not step."""

    norms: tuple[float, ...]

    @property
    def nonfinite(self) -> tuple[int, ...]:
        """The adapters whose gradient held NaN/Inf: their gradients were dropped."""
        return tuple(k for k, norm in enumerate(self.norms) if not math.isfinite(norm))

    @property
    def total(self) -> float:
        """The norm of every finite adapter's gradient together (the adapters that stepped)."""
        return math.sqrt(sum(n * n for n in self.norms if math.isfinite(n)))


def clip_per_adapter(param_groups: Sequence[dict], max_norm: float | Sequence[float],
                     names: Sequence[str] = ()) -> AdapterNorms:
    """Collective under FSDP/TP: clip each adapter's gradients (group k: adapter k) to `max_norm` (one for all,
    or one per adapter) by its own total norm, and drop the gradients of an adapter whose norm is NaN/Inf
    (logged by its name, from `names`, or index), so `optimizer.step()` skips it."""
    bounds = [max_norm] * len(param_groups) if isinstance(max_norm, (int, float)) else list(max_norm)
    if len(bounds) != len(param_groups):
        raise ValueError(f"{len(bounds)} max norms for {len(param_groups)} adapters: give one per adapter")
    norms = []
    for k, (group, bound) in enumerate(zip(param_groups, bounds)):
        norm = float(clip_grad_norm_(group["params"], bound, foreach=True))
        if not math.isfinite(norm):
            for param in group["params"]:
                param.grad = None
            logger.error("adapter %s: gradient norm %s; its gradients are dropped and it skips this step, "
                         "the other adapters step", names[k] if names else k, norm)
        norms.append(norm)
    return AdapterNorms(tuple(norms))
