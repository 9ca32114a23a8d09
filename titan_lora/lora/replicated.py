"""Adapters replicated over the data-parallel ranks, outside FSDP, their gradients summed in one all-reduce.

FSDP2's per-parameter work runs on the host for every sharded param, at every unshard, reshard and
reduce-scatter: a block with LoRA on its 7 linears holds 23 params where the frozen base has 9, so a
LoRA step spent more host time in FSDP than a full fine-tuning step (docs/benchmarks.md). The adapters
are a fraction of a percent of the model: kept whole on every rank they cost a few hundred MB, and their
gradients need one all-reduce of a flat buffer per step instead of FSDP's per-block reduce-scatters.
The sum (not the mean) matches torchtitan's FSDP, whose gradient division is disabled: the loss is
already divided by the global token count.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from titan_lora.lora.layer import local_part


_LIVE: weakref.WeakSet = weakref.WeakSet()
_accumulating = False


@contextlib.contextmanager
def one_sum_for_the_step(model: nn.Module) -> Iterator[None]:
    """Every backward run inside accumulates into `model`'s replicated adapters' gradients, which are summed
    over the ranks once, when the scope ends without an error (a step of several micro-batch backwards);
    every rank must run it. Without it each backward is summed when it ends."""
    global _accumulating
    _accumulating = True
    try:
        yield
    finally:
        _accumulating = False
    params = {id(p) for p in model.parameters()}
    for summer in list(_LIVE):  # the same summers on every rank: the same all-reduces
        if id(summer.params[0]) in params:
            summer.sum_grads()


class ReplicatedGradSum:
    """Sums the gradients of `params` over `group` once per backward, when the backward ends (inside
    `one_sum_for_the_step`: once, after the step's last backward).

    The first gradient of a backward queues the sum as an autograd callback (as FSDP2 queues its own
    post-backward work), so every training loop gets it with no call of its own. A second backward
    into gradients already summed (no `zero_grad` between) would sum them again: it is refused."""

    def __init__(self, params: Sequence[nn.Parameter], group: dist.ProcessGroup,
                 reduce_dtype: torch.dtype) -> None:
        """`reduce_dtype`: the dtype the sum runs in (torchtitan's `mixed_precision_reduce`)."""
        self.params = list(params)
        self.group = group
        locals_ = [local_part(p) for p in self.params]
        self.flat = torch.empty(sum(t.numel() for t in locals_), dtype=reduce_dtype, device=locals_[0].device)
        self.views, offset = [], 0
        for t in locals_:
            self.views.append(self.flat[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()
        self._queued_for = -1  # the autograd graph task (one backward) whose sum is queued
        self._summed: dict[int, weakref.ref] = {}  # id(param) -> its gradient as the last sum left it
        for param in self.params:
            param.register_post_accumulate_grad_hook(self._queue)
        _LIVE.add(self)

    def _queue(self, param: torch.Tensor) -> None:
        if _accumulating:
            return  # summed once, at the end of `one_sum_for_the_step`
        summed = self._summed.get(id(param))
        if summed is not None and summed() is param.grad:
            raise RuntimeError(
                "a second backward accumulated into adapter gradients that were already summed over the "
                "data-parallel ranks ([lora] replicate_adapters): call zero_grad() (set_to_none=True, "
                "torchtitan's default) before each backward, or set [lora] replicate_adapters = false to "
                "accumulate gradients over several backwards"
            )
        # Keyed by the backward, not a flag: a backward that fails drops its queued callback unrun.
        task = torch._C._current_graph_task_id()
        if self._queued_for != task:
            self._queued_for = task
            torch.autograd.Variable._execution_engine.queue_callback(self.sum_grads)

    @torch.no_grad()
    def sum_grads(self) -> None:
        """All-reduce (sum) every param's gradient in one collective; a param with none gets zeros."""
        for param in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        grads = [local_part(p.grad) for p in self.params]
        torch._foreach_copy_(self.views, grads)
        dist.all_reduce(self.flat, group=self.group)
        torch._foreach_copy_(grads, self.views)
        self._summed = {id(p): weakref.ref(p.grad) for p in self.params}
