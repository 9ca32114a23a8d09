"""GRPO's pure pieces, the task and the reward registry."""

from __future__ import annotations

import pytest
import torch

from titan_lora.rl.extract import last_number
from titan_lora.rl.grpo import group_advantages, k3_kl, policy_loss
from titan_lora.rl.rewards import get_reward, register_reward
from titan_lora.rl.task import Problem, train_and_heldout
from titan_lora.rl.tasks import ArithTask, exact_match, make_problems


def test_group_advantages_normalise_within_each_group():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]), group_size=4)
    assert torch.allclose(adv[:4], torch.tensor([3.0, -1.0, -1.0, -1.0]) / 3**0.5, atol=1e-4)
    assert torch.equal(adv[4:], torch.zeros(4)), "a group with one reward value carries no signal"
    # A spread far below 1 is still normalised to +-1 (std 1e-6, eps 1e-6: (r - mean) / 2e-6 = +-0.5).
    tiny = group_advantages(torch.tensor([0.0, 2e-6], dtype=torch.float64), group_size=2)
    assert torch.allclose(tiny, torch.tensor([-0.5, 0.5], dtype=torch.float64))
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(torch.ones(4), group_size=3)


def test_the_policy_loss_is_minus_the_advantage_with_the_gradient_of_minus_advantage_times_logp():
    logp = torch.log(torch.tensor([[0.5, 0.25], [0.1, 0.9]])).requires_grad_()
    loss = policy_loss(logp, torch.tensor([2.0, -0.5]))
    assert torch.equal(loss.detach(), torch.tensor([[-2.0, -2.0], [0.5, 0.5]]))  # the ratio is exactly 1
    loss.sum().backward()
    assert torch.equal(logp.grad, torch.tensor([[-2.0, -2.0], [0.5, 0.5]]))


def test_k3_kl_hand_computed_values():
    # k3 = e^d - d - 1 with d = ref - logp: d = -1 -> e^-1 = 0.367879; d = 1 -> e - 2 = 0.718282;
    # d = 2 -> e^2 - 3 = 4.389056.
    logp = torch.tensor([-1.0, -2.0, -3.0])
    ref = torch.tensor([-2.0, -1.0, -1.0])
    assert torch.allclose(k3_kl(logp, ref), torch.tensor([0.367879, 0.718282, 4.389056]), atol=1e-6)


def test_k3_kl_is_zero_at_equality_and_positive_elsewhere():
    logp = torch.linspace(-8.0, -0.01, 41)
    assert torch.equal(k3_kl(logp, logp), torch.zeros(41))
    ref = logp.flip(0)
    kl = k3_kl(logp, ref)
    assert (kl[ref != logp] > 0).all() and (kl >= 0).all()


def test_k3_kl_gradient_pushes_logp_towards_the_reference():
    # d k3 / d logp = 1 - e^(ref - logp): 1 - e = -1.718282 below the reference, 1 - e^-1 = 0.632121 above.
    logp = torch.tensor([-2.0, -1.0, -1.5], requires_grad=True)
    ref = torch.tensor([-1.0, -2.0, -1.5])
    k3_kl(logp, ref).sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([-1.718282, 0.632121, 0.0]), atol=1e-6)


def test_tasks_are_seeded_and_heldout_is_disjoint():
    assert make_problems(5, seed=3) == make_problems(5, seed=3)
    train, held = train_and_heldout(ArithTask(max_digits=2), 100, 30, seed=0)
    assert not {p.question for p in train} & {p.question for p in held}
    assert last_number("12 + 7 = 19.") == "19" and last_number("minus -3") == "-3"
    assert last_number("none") is None
    assert exact_match("The answer is 8", Problem("What is 5 + 3?", 8)) == 1.0
    assert exact_match("8, or 9", Problem("What is 5 + 3?", 8)) == 0.0


def test_reward_registry_and_import_paths():
    assert get_reward("exact_match") is exact_match
    register_reward("always_one", lambda text, problem: 1.0)
    assert get_reward("always_one")("x", Problem("q", 0)) == 1.0
    assert get_reward("titan_lora.rl.tasks:exact_match") is exact_match
    with pytest.raises(ValueError, match=r"\[grpo\] reward = 'nope' is not registered; known: .*exact_match"):
        get_reward("nope")
    with pytest.raises(ValueError, match=r"cannot load 'titan_lora.rl.tasks:nope'"):
        get_reward("titan_lora.rl.tasks:nope")
