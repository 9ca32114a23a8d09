"""K adapters on one base, each row through its own: exact against each adapter trained alone.

The reference is today's single-adapter path (the `LoRALayer` linear, one AdamW, one clip over its params),
run once per adapter on that adapter's rows; the mixed run trains all three in one batch, one forward and
backward a step.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from dist_helpers import needs_gpus
from model_helpers import DEBUG_LORA, build_from, convert_linear, init_adapters
from multi_helpers import adapter_param_groups, params_by_adapter
from multi_helpers import init_adapters as init_multi_adapters

from titan_lora.lora.layer import adapter_params, freeze_base, is_adapter_param, lora_scale
from titan_lora.lora.multi import AdapterShape, adapter_of, add_adapters, batched_delta
from titan_lora.lora.multi_optim import clip_per_adapter
from titan_lora.lora.multi_rows import AdapterRows, group_rows, routed
from titan_lora.titan.optim import clip_grad_norm_

LINEARS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
# Different ranks, alphas, targets, learning rates, LR schedules and seeds.
ADAPTERS = (
    dict(rank=4, alpha=8, targets=LINEARS, lr=1e-2, seed=11),
    dict(rank=8, alpha=4, targets=("wq", "wv", "w2"), lr=3e-3, seed=12),
    dict(rank=2, alpha=16, targets=("wo", "w1", "w3"), lr=2e-2, seed=13),
)
STEPS, MAX_NORM = 10, 0.01
ROW_ADAPTER = [2, 0, 1, 0, 2, 1, 1, 0, 0]  # interleaved, counts 4/3/2: group_rows must sort them
TOKENS = torch.randint(0, 49152, (len(ROW_ADAPTER), 16), generator=torch.Generator().manual_seed(0))


def schedule(k: int):
    """Adapter k's own warm-up: k + 2 steps."""
    return lambda step: min(1.0, (step + 1) / (k + 2))


@pytest.fixture(scope="module")
def base() -> nn.Module:
    model = build_from(DEBUG_LORA.replace('converters = ["lora"]', "converters = []")).model
    model.requires_grad_(False)
    return model


def _targeted(model: nn.Module, targets: tuple[str, ...]) -> list[nn.Linear]:
    return [m for n, m in model.named_modules()
            if n.rsplit(".", 1)[-1] in targets and isinstance(m, nn.Linear)]


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def train_alone(base: nn.Module, k: int, loss_factor: float = 1.0, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Adapter k alone on its own rows, as titan_lora trains one adapter today; its weights by name."""
    spec = ADAPTERS[k]
    model = copy.deepcopy(base)
    for linear in _targeted(model, spec["targets"]):
        scale = lora_scale(spec["rank"], spec["alpha"], False)
        convert_linear(linear, spec["rank"], scale, 0.0, torch.float32)
    init_adapters(model, spec["seed"])
    freeze_base(model)
    model.to(device)
    params = [p for _, p in adapter_params(model)]
    opt = torch.optim.AdamW(params, lr=spec["lr"], weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(k))
    rows = TOKENS[[i for i, a in enumerate(ROW_ADAPTER) if a == k]].to(device)
    for _ in range(STEPS):
        opt.zero_grad()
        (_loss(model, rows) * loss_factor).backward()
        clip_grad_norm_(params, MAX_NORM, foreach=True)
        opt.step()
        sched.step()
    return {n: p.detach().cpu() for n, p in adapter_params(model)}


def mixed_model(base: nn.Module) -> nn.Module:
    """`base` with the three adapters on their own targets, seeded as each alone run."""
    model = copy.deepcopy(base)
    for name, linear in [(n, m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in LINEARS]:
        leaf = name.rsplit(".", 1)[-1]
        add_adapters(linear, [AdapterShape(a["rank"], lora_scale(a["rank"], a["alpha"], False))
                              if leaf in a["targets"] else None for a in ADAPTERS])
    init_multi_adapters(model, [a["seed"] for a in ADAPTERS])
    freeze_base(model)
    return model


def train_mixed(base: nn.Module, loss_factors=(1.0, 1.0, 1.0),
                poison_step: int | None = None, device: str = "cpu"):
    """All three adapters in one batch, one forward and backward a step: their weights, each step's norms
    and adapter 2's weights before each step, and the model.

    At `poison_step` adapter 2's loss is NaN."""
    model = mixed_model(base).to(device)
    groups = adapter_param_groups(params_by_adapter(model, len(ADAPTERS)), [a["lr"] for a in ADAPTERS])
    opt = torch.optim.AdamW(groups, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [schedule(k) for k in range(len(ADAPTERS))])
    order, rows = group_rows(ROW_ADAPTER, len(ADAPTERS))
    tokens, history = TOKENS[order].to(device), []
    for step in range(STEPS):
        opt.zero_grad()
        with routed(model, rows):
            logits = model(tokens)[:, :-1]
            losses = []
            for k in range(len(ADAPTERS)):  # each adapter's loss normalised by its own token count
                start, end = rows.bounds(k)
                seg = logits[start:end]
                ce = F.cross_entropy(seg.reshape(-1, seg.shape[-1]), tokens[start:end, 1:].reshape(-1))
                losses.append(ce * loss_factors[k])
            if step == poison_step:
                losses[2] = losses[2] * float("nan")
            sum(losses).backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters() if adapter_of(n) == 2}
        history.append((clip_per_adapter(opt.param_groups, MAX_NORM), before))
        opt.step()
        sched.step()
    return {n: p.detach().cpu() for n, p in adapter_params(model)}, history, model


def _as_alone(weights: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
    """Adapter k's tensors of a mixed model, under the names the single-adapter model gives them."""
    return {n.rsplit("_", 1)[0]: t for n, t in weights.items() if adapter_of(n) == k}


@pytest.fixture(scope="module")
def alone(base: nn.Module) -> list[dict[str, torch.Tensor]]:
    return [train_alone(base, k) for k in range(len(ADAPTERS))]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def test_three_adapters_in_one_batch_end_as_each_trained_alone(base, alone) -> None:
    mixed, history, _ = train_mixed(base)
    for k in range(len(ADAPTERS)):
        diff = _max_diff(_as_alone(mixed, k), alone[k])
        print(f"adapter {k}: max abs diff to alone {diff:.3g}")
        assert diff <= 1e-6, k
        assert any(float(t.abs().max()) > 1e-3 for n, t in alone[k].items() if n.endswith("lora_B")), k
    # Clipping did bite (else per-adapter clipping would be untested), and not for every adapter alike.
    first = history[0][0].norms
    assert min(first) < MAX_NORM < max(first), first


@needs_gpus(1)
def test_three_adapters_in_one_batch_on_a_gpu_end_as_each_trained_alone_there(base) -> None:
    """The same on CUDA, float32 without TF32: the row slices and per-adapter clipping on the GPU's kernels.
    cuBLAS picks its kernels by the batch's shape, so a mixed batch sums in another order than one adapter's
    rows alone, and Adam's normalised steps carry that over 10 steps (1.9e-05 seen on an H100); a row of
    another adapter leaking in moves the weights by more than 1e-3."""
    torch.backends.cuda.matmul.allow_tf32 = False
    mixed, _, _ = train_mixed(base, device="cuda")
    for k in range(len(ADAPTERS)):
        alone = train_alone(base, k, device="cuda")
        diff = _max_diff(_as_alone(mixed, k), alone)
        print(f"CUDA adapter {k}: max abs diff to alone {diff:.3g}")
        assert diff <= 1e-4, k
        assert any(float(t.abs().max()) > 1e-3 for n, t in alone.items() if n.endswith("lora_B")), k


def test_a_huge_gradient_on_one_adapter_leaves_the_others_updates_unchanged(base, alone) -> None:
    mixed, history, _ = train_mixed(base, loss_factors=(1.0, 1e6, 1.0))
    assert min(norms.norms[1] for norms, _ in history) > 1e3
    for k in (0, 2):  # one norm over all adapters would have scaled their updates down by about 1e6
        assert _max_diff(_as_alone(mixed, k), alone[k]) <= 1e-6, k


def test_a_nan_gradient_skips_only_its_adapter_and_names_it(base, alone, caplog) -> None:
    with caplog.at_level(logging.ERROR, logger="titan_lora.lora.multi_optim"):
        mixed, history, model = train_mixed(base, poison_step=4)
    assert [norms.nonfinite for norms, _ in history] == [()] * 4 + [(2,)] + [()] * 5
    assert "adapter 2: gradient norm nan" in caplog.text
    for k in (0, 1):
        assert _max_diff(_as_alone(mixed, k), alone[k]) <= 1e-6, k
    # Adapter 2 skipped the poisoned step (its weights as before it) and trained on, finite.
    after_skip = {n: p.detach() for n, p in model.named_parameters() if adapter_of(n) == 2}
    assert _max_diff(history[4][1], history[5][1]) == 0.0
    assert all(torch.isfinite(t).all() for t in after_skip.values())
    assert _max_diff(history[5][1], history[6][1]) > 0.0


# ---------------------------------------------------------------- the layer


def _layer(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(12, 10)
    linear.requires_grad_(False)
    add_adapters(linear, [AdapterShape(4, 0.5), None, AdapterShape(2, 3.0)])
    with torch.no_grad():
        for name, param in linear.named_parameters():
            if is_adapter_param(name):
                param.normal_()
    return linear


def test_each_row_gets_its_own_adapters_delta_and_gradient() -> None:
    linear = _layer()
    row_adapter = [2, 0, 1, 2, 0, 0]
    order, rows = group_rows(row_adapter, 3)
    assert rows == AdapterRows((3, 1, 2)) and rows.offsets == (0, 3, 4, 6)
    assert order.tolist() == [1, 4, 5, 2, 0, 3], "stable: each adapter's rows keep the batch's order"
    x = torch.randn(6, 5, 12)[order]
    with routed(linear, rows):
        y = linear(x)
    assert linear.adapter_rows is None, "the rows do not outlive the scope"
    scales = {0: 0.5, 2: 3.0}
    for i, k in enumerate(sorted(row_adapter)):
        want = F.linear(x[i], linear.weight, linear.bias)
        if k in scales:  # adapter 1 does not target this linear: its rows get the base alone
            a, b = getattr(linear, f"lora_A_{k}"), getattr(linear, f"lora_B_{k}")
            want = want + scales[k] * x[i] @ a.T @ b.T
        torch.testing.assert_close(y[i], want, rtol=0, atol=1e-5)
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    for k, (start, end) in ((0, (0, 3)), (2, (4, 6))):
        a, b = getattr(linear, f"lora_A_{k}"), getattr(linear, f"lora_B_{k}")
        h = x[start:end] @ a.T
        g = grad_out[start:end] * scales[k]
        torch.testing.assert_close(b.grad, torch.einsum("nto,ntr->or", g, h), rtol=1e-5, atol=1e-5)


def _stackable_layer(device: str = "cpu") -> nn.Linear:
    """Three adapters of one rank and different scales, all on the linear: the GPU's batched path applies."""
    torch.manual_seed(3)
    linear = nn.Linear(12, 10)
    linear.requires_grad_(False)
    add_adapters(linear, [AdapterShape(4, 0.5), AdapterShape(4, 2.0), AdapterShape(4, 3.0)])
    with torch.no_grad():
        for name, param in linear.named_parameters():
            if is_adapter_param(name):
                param.normal_()
    return linear.to(device)


def _loop_reference(linear: nn.Linear, x: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The output and adapter gradients of the per-segment loop (CPU), for three equal shares of rows."""
    reference = copy.deepcopy(linear).cpu()
    with routed(reference, AdapterRows((2, 2, 2))):
        y = reference(x.cpu())
    y.backward(grad_out.cpu())
    return y.detach(), {n: p.grad for n, p in reference.named_parameters() if is_adapter_param(n)}


def test_the_batched_delta_equals_the_per_segment_loop_with_its_gradients() -> None:
    linear = _stackable_layer()
    x, grad_out = torch.randn(6, 5, 12), torch.randn(6, 5, 10)
    want, want_grads = _loop_reference(linear, x, grad_out)
    a = [getattr(linear, f"lora_A_{k}") for k in range(3)]
    b = [getattr(linear, f"lora_B_{k}") for k in range(3)]
    y = F.linear(x, linear.weight, linear.bias) + batched_delta(x, a, b, torch.tensor([0.5, 2.0, 3.0]).view(3, 1, 1))
    y.backward(grad_out)
    torch.testing.assert_close(y, want, rtol=0, atol=1e-5)
    for name, param in linear.named_parameters():
        if is_adapter_param(name):
            torch.testing.assert_close(param.grad, want_grads[name], rtol=1e-5, atol=1e-5)


@needs_gpus(1)
def test_a_gpu_linear_takes_the_batched_path_for_equal_shares_and_matches_the_loop() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    linear = _stackable_layer("cuda")
    x, grad_out = torch.randn(6, 5, 12, device="cuda"), torch.randn(6, 5, 10, device="cuda")
    want, want_grads = _loop_reference(linear, x, grad_out)
    assert linear._stackable(AdapterRows((2, 2, 2))) and not linear._stackable(AdapterRows((3, 2, 1)))
    with routed(linear, AdapterRows((2, 2, 2))):
        y = linear(x)
    y.backward(grad_out)
    torch.testing.assert_close(y.cpu(), want, rtol=0, atol=1e-5)
    for name, param in linear.named_parameters():
        if is_adapter_param(name):
            torch.testing.assert_close(param.grad.cpu(), want_grads[name], rtol=1e-5, atol=1e-5)


def test_an_adapter_with_no_rows_still_gets_a_zero_gradient() -> None:
    # Every data-parallel rank must produce gradients for the same params, or FSDP2's reduce-scatters differ.
    linear = _layer()
    with routed(linear, AdapterRows((3, 0, 0))):
        linear(torch.randn(3, 12)).pow(2).sum().backward()
    assert linear.lora_A_2.grad is not None and not linear.lora_A_2.grad.any()
    assert linear.lora_A_0.grad.abs().sum() > 0


def test_adapter_params_are_named_per_adapter_and_stay_trainable() -> None:
    linear = _layer()
    names = {n for n, _ in linear.named_parameters()}
    assert names == {"weight", "bias", "lora_A_0", "lora_B_0", "lora_A_2", "lora_B_2"}
    freeze_base(linear)
    assert {n for n, p in linear.named_parameters() if p.requires_grad} == names - {"weight", "bias"}
    names_of = ("x.lora_A_0", "x.lora_B_12", "x.lora_A", "x.weight")
    assert [adapter_of(n) for n in names_of] == [0, 12, None, None]
    with pytest.raises(ValueError, match=r"adapters \[1\] target no linear"):
        params_by_adapter(linear, 3)


@pytest.mark.parametrize("rows, match", [
    (None, "outside multi_rows.routed"),
    (AdapterRows((1, 1, 0)), "count 2 rows for a batch of 3"),
    (AdapterRows((3, 0)), "give 2 counts for a model with 3 adapters"),
])
def test_rows_that_do_not_fit_the_batch_are_refused(rows, match) -> None:
    linear = _layer()
    with pytest.raises((ValueError, RuntimeError), match=match):
        if rows is None:
            linear(torch.randn(3, 12))
        else:
            with routed(linear, rows):
                linear(torch.randn(3, 12))
