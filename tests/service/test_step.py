"""The service's mixed step on a small random SmolLM2 (1 rank): a client's result does not depend on who else
shares its step, and a rank-r client in a slot of a larger rank trains exactly as a rank-r adapter does."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch
from model_helpers import DEBUG_LORA

from titan_lora.config_adapters import Adapter
from titan_lora.lora.multi import param_pattern
from titan_lora.service.main import build_slots, service_job
from titan_lora.service.slots import AdamStep, SlotSpec
from titan_lora.service.step import Limits, Work, micro_batches, run_step
from titan_lora.service.wire import Datum, ForwardBackward
from titan_lora.trainer.build import build_model
from titan_lora.titan.parallel import build_parallel_dims
from titan_lora.trainer.distributed import init_distributed
from titan_lora.trainer.job_config import job_from_toml

SERVICE = DEBUG_LORA + "[service]\nmax_adapters = 4\nmax_rank = 16\nlora_alpha = 32\n"
CPU = torch.device("cpu")
ADAM = AdamStep(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)


def _request(seed: int, rows: int = 2, length: int = 12, vocab: int = 2000) -> ForwardBackward:
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(rows):
        tokens = rng.integers(0, vocab, length + 1)
        weights = np.r_[np.zeros(length // 2), np.ones(length - length // 2)].astype(np.float32)
        data.append(Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": weights}))
    return ForwardBackward("m", 1, "cross_entropy", {}, False, data)


@pytest.fixture(scope="module")
def service():
    init_distributed(CPU)
    cfg, resolved = job_from_toml(SERVICE)
    built, slots, _ = build_slots(service_job(cfg), resolved, CPU)
    limits = Limits(resolved.shape.vocab_size, 64, 4096)
    return built.model, slots, limits


def _train(model, slots, limits, plan: list[list[tuple[int, ForwardBackward]]]) -> dict[int, list[float]]:
    """Run each round's works as one step, then step every slot in it; each slot's losses."""
    losses: dict[int, list[float]] = {}
    for works in plan:
        outcomes = run_step(model, [Work(s, r) for s, r in works], slots.count, limits, CPU)
        for (slot, _), outcome in zip(works, outcomes):
            assert outcome.error is None, outcome.error
            losses.setdefault(slot, []).append(outcome.metrics["loss:sum"])
        for slot in sorted({s for s, _ in works}):
            slots.step(slot, ADAM)
    return losses


def _params(slots, slot: int) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in slots.params[slot]}


def test_a_client_trains_the_same_alone_and_mixed_with_others(service) -> None:
    model, slots, limits = service
    a, b = SlotSpec(rank=4, seed=1), SlotSpec(rank=16, seed=2)
    slots.claim(0, a)
    alone = _train(model, slots, limits, [[(0, _request(0))] for _ in range(3)])
    after_alone = _params(slots, 0)
    probe = dataclasses.replace(_request(7), forward_only=True)
    (seen_alone,) = run_step(model, [Work(0, probe)], slots.count, limits, CPU)
    slots.claim(0, a)
    slots.claim(1, b)
    mixed = _train(model, slots, limits, [[(1, _request(10 + i, rows=3, length=20)), (0, _request(0))]
                                          for i in range(3)])
    assert alone[0][-1] < alone[0][0]  # it learns
    np.testing.assert_allclose(mixed[0], alone[0], rtol=1e-6)
    seen_mixed = run_step(model, [Work(1, _request(8)), Work(0, probe)], slots.count, limits, CPU)[1]
    for ours, theirs in zip(seen_mixed.logprobs, seen_alone.logprobs):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)
    # The weights: a batch of other shapes rounds the base matmuls differently (~1e-7), and Adam's
    # normalisation (g / sqrt(v)) carries that to ~1e-5 on an element whose gradient is near 0 (lr 1e-2;
    # measured: up to 7.2e-6, on one element of 3072, on weights of up to 0.14).
    for name, value in _params(slots, 0).items():
        torch.testing.assert_close(value, after_alone[name], rtol=0, atol=1e-5)
    assert mixed[1] != mixed[0]


def test_four_clients_mixed_in_every_step_each_train_as_alone(service) -> None:
    """Four clients of different ranks, seeds and data (rows, lengths), every step mixing all four: each
    one's losses and weights equal what it gets alone (1e-6 on the losses)."""
    model, slots, limits = service
    specs = [SlotSpec(rank=r, seed=20 + k) for k, r in enumerate((4, 8, 16, 2))]
    plans = [[_request(100 * k, rows=1 + k % 3, length=10 + 3 * k)] * 3 for k in range(4)]  # its own data
    alone, weights = {}, {}
    for k, spec in enumerate(specs):
        slots.claim(k, spec)
        alone[k] = _train(model, slots, limits, [[(k, request)] for request in plans[k]])[k]
        weights[k] = _params(slots, k)
    for k, spec in enumerate(specs):
        slots.claim(k, spec)
    mixed = _train(model, slots, limits, [[(k, plans[k][i]) for k in (2, 0, 3, 1)] for i in range(3)])
    for k in range(4):
        assert alone[k][-1] < alone[k][0], (k, alone[k])  # each learns
        np.testing.assert_allclose(mixed[k], alone[k], rtol=1e-6)
        for name, value in _params(slots, k).items():  # Adam carries ~1e-7 of rounding to ~1e-5 (see above)
            torch.testing.assert_close(value, weights[k][name], rtol=0, atol=1e-5)


def test_the_padded_rank_stays_zero_and_the_other_slots_untouched(service) -> None:
    model, slots, limits = service
    slots.claim(0, SlotSpec(rank=4, seed=3))
    slots.claim(2, SlotSpec(rank=8, seed=4))
    untouched = _params(slots, 2)
    _train(model, slots, limits, [[(0, _request(i))] for i in range(2)])
    for name, value in _params(slots, 0).items():
        padded = value[4:] if "lora_A" in name else value[:, 4:]
        assert padded.abs().max() == 0, name
        assert value.abs().max() > 0, name
    assert all(torch.equal(v, untouched[n]) for n, v in _params(slots, 2).items())


def test_a_rank_4_client_equals_a_rank_4_adapter(service) -> None:
    """The slot (built at rank 16) against a model built with rank-4 adapters, trained with the same calls."""
    model, slots, limits = service
    slots.claim(0, SlotSpec(rank=4, seed=0))
    ours = _train(model, slots, limits, [[(0, _request(i))] for i in range(3)])
    cfg, resolved = job_from_toml(SERVICE)
    cfg = dataclasses.replace(cfg, adapters=[Adapter(name=n, rank=4, alpha=32) for n in ("a", "b")])
    reference = build_model(cfg, build_parallel_dims(cfg.parallelism, 1, CPU), CPU, resolved).model
    base = {k: v for k, v in model.state_dict().items() if "lora_" not in k}  # the same random base
    assert not reference.load_state_dict(base, strict=False).unexpected_keys
    params = [p for n, p in reference.named_parameters() if re.search(param_pattern(0), n)]
    assert params
    optimizer = torch.optim.AdamW(params, lr=ADAM.learning_rate, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    theirs = []
    for i in range(3):
        (outcome,) = run_step(reference, [Work(0, _request(i))], 2, limits, CPU)
        theirs.append(outcome.metrics["loss:sum"])
        optimizer.step()
        optimizer.zero_grad()
    np.testing.assert_allclose(ours[0], theirs, rtol=1e-6)


def test_a_bad_request_fails_alone_and_changes_nothing(service) -> None:
    model, slots, limits = service
    slots.claim(0, SlotSpec(rank=4, seed=5))
    slots.claim(1, SlotSpec(rank=4, seed=6))
    before = _params(slots, 0)
    bad = _request(1)
    bad.data[1].tokens[3] = limits.vocab_size + 7
    short = _request(2)
    short.data[0].inputs["weights"] = short.data[0].inputs["weights"][:-1]
    unknown = dataclasses.replace(_request(3), loss_fn="dro")
    outcomes = run_step(model, [Work(0, bad), Work(0, short), Work(0, unknown), Work(1, _request(4))],
                        slots.count, limits, CPU)
    assert f"token id {limits.vocab_size + 7} outside the vocabulary" in outcomes[0].error
    assert "loss_fn_inputs['weights'] has shape [11]" in outcomes[1].error
    assert "loss_fn 'dro' is not served" in outcomes[2].error
    assert outcomes[3].error is None and outcomes[3].metrics["loss:sum"] > 0
    # Every slot of a linear runs on every batch (FSDP's reduce-scatters must match), on no rows here: zeros.
    assert all(p.grad is None or not p.grad.any() for _, p in slots.params[0])
    assert all(torch.equal(v, before[n]) for n, v in _params(slots, 0).items())


def test_micro_batches_cut_in_order_by_padded_tokens() -> None:
    rows = [(r, (0, Datum(np.zeros(n, dtype=np.int64)))) for r, n in enumerate((10, 30, 20, 50, 5))]
    cut = micro_batches(rows, 60)
    assert [[r for r, _ in batch] for batch in cut] == [[0, 1], [2], [3], [4]]  # 2 x 30; 20 + 50 > 60; ...
    assert [[r for r, _ in batch] for batch in micro_batches(rows, 1)] == [[0], [1], [2], [3], [4]]
    assert micro_batches([], 60) == []


def test_a_step_in_micro_batches_gives_what_one_forward_gives(service) -> None:
    """Every row alone (micro_batch_tokens 1) against the whole step in one forward: the same log-probs and
    losses, and the same accumulated gradients."""
    model, slots, limits = service
    works = [Work(0, _request(30, rows=3)), Work(1, _request(31, rows=2, length=20))]
    seen = {}
    for budget in (1, 1 << 20):
        for k in (0, 1):
            slots.claim(k, SlotSpec(rank=8, seed=40 + k))
        outcomes = run_step(model, works, slots.count, dataclasses.replace(limits, micro_batch_tokens=budget), CPU)
        grads = {n: p.grad.clone() for k in (0, 1) for n, p in slots.params[k] if p.grad is not None}
        seen[budget] = (outcomes, grads)
    (alone, alone_grads), (whole, whole_grads) = seen[1], seen[1 << 20]
    for ours, theirs in zip(alone, whole):
        assert ours.metrics["loss:sum"] == pytest.approx(theirs.metrics["loss:sum"], rel=1e-6)
        for a, b in zip(ours.logprobs, theirs.logprobs):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    assert whole_grads.keys() == alone_grads.keys() and whole_grads
    for name, grad in whole_grads.items():
        torch.testing.assert_close(alone_grads[name], grad, rtol=1e-4, atol=1e-6)
