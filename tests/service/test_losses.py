"""Tinker's losses as titan_lora computes them: sums over tokens, with Tinker's documented formulas."""

from __future__ import annotations

import pytest
import torch

from titan_lora.service.losses import LossInputError, check_loss, datum_loss

LOGP = torch.tensor([-1.0, -0.5, -2.0])
OLD = torch.tensor([-1.0, -1.0, -1.0])
ADV = torch.tensor([0.0, 2.0, -1.0])


def test_cross_entropy_is_the_weighted_sum() -> None:
    assert datum_loss("cross_entropy", LOGP, {"weights": torch.tensor([0.0, 1.0, 0.5])}, {}) == pytest.approx(1.5)


def test_importance_sampling_weights_the_advantage_by_the_ratio() -> None:
    ratios = torch.exp(LOGP - OLD)
    expected = -(ratios * ADV).sum()
    assert datum_loss("importance_sampling", LOGP, {"logprobs": OLD, "advantages": ADV}, {}) == pytest.approx(
        float(expected))


def test_ppo_clips_the_ratio_at_its_thresholds() -> None:
    inputs = {"logprobs": OLD, "advantages": ADV}
    # ratio e^0.5 = 1.65 with A = 2: clipped to 1.2 -> -2.4; ratio e^-1 = 0.37 with A = -1: min(-0.37, -0.8) = -0.8
    assert datum_loss("ppo", LOGP, inputs, {}) == pytest.approx(-(0 + 1.2 * 2 + 0.8 * -1))
    assert datum_loss("ppo", LOGP, inputs, {"clip_high_threshold": 1.5, "clip_low_threshold": 0.5}) == pytest.approx(
        -(1.5 * 2 + 0.5 * -1))


def test_inputs_are_checked_by_name_and_length() -> None:
    with pytest.raises(LossInputError, match="needs loss_fn_inputs\\['advantages'\\]"):
        check_loss("ppo", {"target_tokens": LOGP, "logprobs": OLD}, 3, 0)
    with pytest.raises(LossInputError, match="datum 2: loss_fn_inputs\\['weights'\\] has shape \\[2\\]"):
        check_loss("cross_entropy", {"target_tokens": LOGP, "weights": LOGP[:2]}, 3, 2)
    with pytest.raises(LossInputError, match="'dro' is not served; titan_lora serves cross_entropy, "
                                             "importance_sampling, ppo, cispo, gspo"):
        check_loss("dro", {}, 3, 0)
    with pytest.raises(LossInputError, match="datum 1: loss_fn_inputs\\['sequence_ratio_mask'\\] marks no token"):
        check_loss("gspo", {"target_tokens": LOGP, "logprobs": OLD, "advantages": ADV,
                            "sequence_ratio_mask": torch.zeros(3)}, 3, 1)


def test_cispo_weights_the_log_prob_by_the_clipped_ratio_without_its_gradient() -> None:
    logp = LOGP.clone().requires_grad_()
    loss = datum_loss("cispo", logp, {"logprobs": OLD, "advantages": ADV}, {"clip_high_threshold": 1.5})
    # ratios 1, e^0.5 = 1.65 -> 1.5, e^-1 = 0.37: -(0 + 1.5 * -0.5 * 2 + 0.37 * -2 * -1)
    assert float(loss) == pytest.approx(-(1.5 * -0.5 * 2 + float(torch.exp(torch.tensor(-1.0))) * -2.0 * -1))
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([0.0, -1.5 * 2, -float(torch.exp(torch.tensor(-1.0))) * -1])
    assert datum_loss("cispo", LOGP, {"logprobs": OLD, "advantages": ADV}, {}) == pytest.approx(
        -(1.0 * -1.0 * 0 + float(torch.exp(torch.tensor(0.5))) * -0.5 * 2 + float(torch.exp(torch.tensor(-1.0))) * -2 * -1))


def test_gspo_gives_every_marked_token_the_sequences_ratio_with_its_own_gradient() -> None:
    mask = torch.tensor([0.0, 1.0, 1.0])  # the prompt token is not in the sequence ratio
    inputs = {"logprobs": OLD, "advantages": ADV, "sequence_ratio_mask": mask}
    logp = LOGP.clone().requires_grad_()
    loss = datum_loss("gspo", logp, inputs, {})
    s = float(torch.exp(((LOGP - OLD)[1:]).mean()))  # exp((0.5 - 1) / 2) = 0.78, under the low bound 0.8
    # token 1 (A = 2): min(s * 2, 0.8 * 2) = 1.56; token 2 (A = -1): min(-s, -0.8) = -0.8
    assert float(loss) == pytest.approx(-(min(s * 2, 0.8 * 2) + min(-s, -0.8)))
    loss.backward()
    # d/dlogp_t of s_t = s_t (its own log-prob's gradient); token 1 unclipped: -A s; token 2 clipped: 0
    assert logp.grad.tolist() == pytest.approx([0.0, -2 * s, 0.0])
    wide = datum_loss("gspo", LOGP, inputs, {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5})
    assert float(wide) == pytest.approx(-(s * 2 - s))
