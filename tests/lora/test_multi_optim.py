"""Per-adapter param groups and clipping: each adapter's norm, its own clip, a non-finite one skipped."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
from multi_helpers import adapter_param_groups

from titan_lora.lora.multi_optim import clip_per_adapter


def _adapters(grads: list[list[float]]) -> list[list[tuple[str, nn.Parameter]]]:
    out = []
    for k, values in enumerate(grads):
        param = nn.Parameter(torch.zeros(len(values)))
        param.grad = torch.tensor(values)
        out.append([(f"wq.lora_A_{k}", param)])
    return out


def test_each_adapter_is_one_group_with_its_own_lr() -> None:
    params = _adapters([[1.0], [2.0]])
    groups = adapter_param_groups(params, [0.1, 0.01])
    assert [(g["adapter"], g["lr"], g["param_names"]) for g in groups] == [
        (0, 0.1, ["wq.lora_A_0"]), (1, 0.01, ["wq.lora_A_1"])]
    opt = torch.optim.AdamW(groups)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.01]
    with pytest.raises(ValueError, match="1 learning rates for 2 adapters"):
        adapter_param_groups(params, [0.1])


def test_each_adapter_is_clipped_by_its_own_norm() -> None:
    groups = adapter_param_groups(_adapters([[3.0, 4.0], [300.0, 400.0], [0.3, 0.4]]), [0.1] * 3)
    norms = clip_per_adapter(groups, max_norm=1.0)
    assert norms.norms == pytest.approx((5.0, 500.0, 0.5)) and norms.nonfinite == ()
    # One norm over all three (500.0) would have scaled adapter 2's 0.3 down to 0.0006.
    got = [g["params"][0].grad for g in groups]
    torch.testing.assert_close(got[0], torch.tensor([0.6, 0.8]))
    torch.testing.assert_close(got[1], torch.tensor([0.6, 0.8]))
    assert torch.equal(got[2], torch.tensor([0.3, 0.4])), "under its own max_norm: untouched"


def test_a_nonfinite_adapter_drops_its_gradients_and_is_named(caplog) -> None:
    groups = adapter_param_groups(_adapters([[1.0], [float("nan")], [float("inf")]]), [0.1] * 3)
    with caplog.at_level(logging.ERROR, logger="titan_lora.lora.multi_optim"):
        norms = clip_per_adapter(groups, max_norm=10.0)
    assert norms.nonfinite == (1, 2)
    assert [g["params"][0].grad is None for g in groups] == [False, True, True]
    assert "adapter 1: gradient norm nan" in caplog.text and "adapter 2: gradient norm inf" in caplog.text
    opt = torch.optim.AdamW(groups)
    opt.step()  # the optimizer skips the dropped ones: their weights and state stay as they were
    assert [float(g["params"][0]) for g in groups][1:] == [0.0, 0.0]
    assert [len(opt.state[g["params"][0]]) for g in groups] == [3, 0, 0]
