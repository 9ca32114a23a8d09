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
