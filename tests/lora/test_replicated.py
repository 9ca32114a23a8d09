"""ReplicatedGradSum on 2 gloo ranks: each backward's gradients are summed over the ranks when it ends,
a param with no gradient gets zeros, and a second backward into summed gradients is refused; inside
`one_sum_for_the_step` several backwards accumulate and are summed once, at its end (not after an error)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from dist_helpers import run_ranks

from titan_lora.lora.replicated import ReplicatedGradSum, one_sum_for_the_step


def _sums(rank: int, world: int) -> None:
    used, unused = nn.Parameter(torch.ones(3, 2)), nn.Parameter(torch.ones(4))
    ReplicatedGradSum([used, unused], dist.group.WORLD, torch.float32)
    scale = float(rank + 1)  # rank 0's gradient is 1 everywhere, rank 1's is 2: the sum is 3
    for step in range(2):
        (used * scale).sum().backward()
        torch.testing.assert_close(used.grad, torch.full((3, 2), 3.0), rtol=0, atol=0)
        assert unused.grad is not None and torch.count_nonzero(unused.grad) == 0, "no gradient: zeros"
        if step == 0:
            with pytest.raises(RuntimeError, match="replicate_adapters = false"):
                (used * scale).sum().backward()  # into the summed gradient: would sum it twice
            used.grad = unused.grad = None  # what zero_grad() does
    # The refused backward must not leave a sum queued: the next one sums once.
    used.grad = unused.grad = None
    (used * scale).sum().backward()
    torch.testing.assert_close(used.grad, torch.full((3, 2), 3.0), rtol=0, atol=0)


def test_gradients_are_summed_over_the_ranks_once_per_backward() -> None:
    run_ranks(2, _sums)


def _fails_midway(rank: int, world: int) -> None:
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    ReplicatedGradSum([a, b], dist.group.WORLD, torch.float32)
    scale = float(rank + 1)
    (a * scale + b * scale).sum().backward()
    a.grad = None  # b keeps its summed gradient: a queues the sum, then b's accumulation is refused
    with pytest.raises(RuntimeError, match="already summed"):
        (a * scale + b * scale).sum().backward()
    a.grad = b.grad = None
    (a * scale + b * scale).sum().backward()  # a failed backward must not leave the next one unsummed
    for param in (a, b):
        torch.testing.assert_close(param.grad, torch.full((2,), 3.0), rtol=0, atol=0)


def test_a_backward_that_fails_after_queueing_its_sum_leaves_the_next_one_summed() -> None:
    run_ranks(2, _fails_midway)


def _micro_batches(rank: int, world: int) -> None:
    model = nn.Linear(2, 1, bias=False)
    other = nn.Parameter(torch.ones(2))  # another model's summer: left alone
    ReplicatedGradSum([model.weight], dist.group.WORLD, torch.float32)
    ReplicatedGradSum([other], dist.group.WORLD, torch.float32)
    scale = float(rank + 1)
    with one_sum_for_the_step(model):
        for _ in range(3):  # three micro-batch backwards, each adding `scale` per element
            (model.weight * scale).sum().backward()
        torch.testing.assert_close(model.weight.grad, torch.full((1, 2), 3 * scale), rtol=0, atol=0)
    torch.testing.assert_close(model.weight.grad, torch.full((1, 2), 9.0), rtol=0, atol=0)  # (3 + 6), once
    assert other.grad is None, "another model's adapters were summed"
    model.weight.grad = None
    with pytest.raises(ValueError, match="midway"), one_sum_for_the_step(model):
        (model.weight * scale).sum().backward()
        raise ValueError("midway")
    torch.testing.assert_close(model.weight.grad, torch.full((1, 2), scale), rtol=0, atol=0)  # not summed


def test_backwards_inside_one_step_accumulate_and_are_summed_once() -> None:
    run_ranks(2, _micro_batches)
