"""The parity probe's comparison: figures by hand, and a violation logged at WARNING with them."""

from __future__ import annotations

import logging

import pytest
import torch

from titan_lora.sync.parity import ParityProbe


def _probe(theirs: list[list[float]]) -> ParityProbe:
    return ParityProbe(torch.nn.Identity(), [[1, 2, 3], [4, 5]], torch.device("cpu"),
                       lambda sequences, adapter: theirs, tolerance=1e-3)


def test_a_violation_is_counted_and_logged_with_its_figures(caplog: pytest.LogCaptureFixture) -> None:
    probe = _probe([[-1.0, -2.5], [-0.25]])
    with caplog.at_level(logging.WARNING, logger="titan_lora.sync.parity"):
        figures = probe.compare([[-1.0, -2.0], [-0.5]], "policy-v4")
    # |diffs| = 0, 0.5, 0.25 -> max 0.5, mean 0.25
    assert figures == {"parity_max_abs": 0.5, "parity_mean_abs": 0.25, "parity_violations": 1}
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "policy-v4" in record.message and "0.5 > [weight_sync] parity_tolerance 0.001" in record.message


def test_agreement_within_the_tolerance_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    probe = _probe([[-1.0, -2.0005], [-0.5]])
    with caplog.at_level(logging.WARNING):
        figures = probe.compare([[-1.0, -2.0], [-0.5]], "policy-v5")
    assert figures["parity_violations"] == 0 and figures["parity_max_abs"] == pytest.approx(5e-4)
    assert caplog.records == []


def test_an_engine_that_returns_fewer_tokens_is_an_error_not_a_pass() -> None:
    with pytest.raises(ValueError):
        _probe([[-1.0], [-0.5]]).compare([[-1.0, -2.0], [-0.5]], "policy-v6")


def test_the_probe_keeps_what_it_was_given_and_scores_the_batch_under_the_adapter() -> None:
    model, seqs, asked = torch.nn.Identity(), [[1, 2, 3], [4, 5]], []
    probe = ParityProbe(model, seqs, torch.device("cpu"),
                        lambda sequences, adapter: asked.append((sequences, adapter)) or [[-1.0, -2.0], [-0.5]],
                        tolerance=0.5)
    assert probe.model is model and probe.sequences is seqs and probe.device == torch.device("cpu")
    assert probe.compare([[-1.0, -2.0], [-0.5]], "policy-v7")["parity_max_abs"] == 0.0
    assert asked == [(seqs, "policy-v7")]


def test_no_score_or_no_adapter_means_no_figures() -> None:
    scored: list[str] = []
    probe = ParityProbe(torch.nn.Identity(), [[1, 2]], torch.device("cpu"),
                        lambda s, adapter: scored.append(adapter) or [[0.0]], tolerance=1e-3)
    assert probe.compare([[0.0]], "") == {} and scored == []
    no_score = ParityProbe(torch.nn.Identity(), [[1, 2]], torch.device("cpu"), None, tolerance=1e-3)
    assert no_score.compare([[0.0]], "policy-v1") == {}


def test_an_engine_that_returns_fewer_sequences_is_an_error() -> None:
    with pytest.raises(ValueError):
        _probe([[-1.0, -2.0]]).compare([[-1.0, -2.0], [-0.5]], "policy-v6")


def test_a_gap_equal_to_the_tolerance_is_no_violation_and_violations_add_up() -> None:
    probe = ParityProbe(torch.nn.Identity(), [[1, 2]], torch.device("cpu"), lambda s, a: [[-1.5]], tolerance=0.5)
    assert probe.compare([[-1.0]], "policy-v1")["parity_violations"] == 0
    probe.tolerance = 0.25
    probe.compare([[-1.0]], "policy-v1")
    assert probe.compare([[-1.0]], "policy-v2")["parity_violations"] == 2


class _TableModel(torch.nn.Module):
    """logits[b, t] = table[token[b, t]]; records whether it ran in eval mode."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = table
        self.modes: list[bool] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.modes.append(self.training)
        return self.table[tokens]


def test_trainer_logprobs_are_log_softmax_of_each_next_token_in_eval_mode() -> None:
    from titan_lora.sync.parity import trainer_logprobs

    # 3-token vocabulary; after token 0 the model puts logits (0, ln 3, 0): p(1) = 3/5, p(2) = 1/5
    table = torch.tensor([[0.0, float(torch.log(torch.tensor(3.0))), 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    model = _TableModel(table)
    model.train()
    probe = ParityProbe(model, [[0, 1, 2], [0, 2]], torch.device("cpu"), None, tolerance=1e-3)
    got = probe.trainer_side()
    third = float(torch.log(torch.tensor(1 / 3)))
    assert len(got) == 2 and len(got[0]) == 2 and len(got[1]) == 1, "one log-prob per token after the first"
    assert got[0] == pytest.approx([float(torch.log(torch.tensor(0.6))), third])
    assert got[1] == pytest.approx([float(torch.log(torch.tensor(0.2)))])
    assert model.modes == [False] and model.training, "scored in eval mode, training mode restored"
    model.eval()
    trainer_logprobs(model, [[0, 1]], torch.device("cpu"))
    assert not model.training
