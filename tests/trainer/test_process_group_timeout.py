"""Rank 0's longest wait between collectives fits inside the process-group timeout."""

from __future__ import annotations

import pytest
from model_helpers import DEBUG_LORA, job_config_from

from titan_lora.config import WeightSync, process_group_timeout_s, rank0_wait_budget_s


def test_the_budget_of_the_defaults_by_hand() -> None:
    # Each try: max(rollout 600, (3 retries + 1) * (120 s + 10 s) + 30 s retire = 550) = 600 s; 3 restarts give
    # 4 tries (2400 s) plus 3 * (600 s start + 10 s health) = 1830 s.
    ws = WeightSync(enabled=True)
    assert rank0_wait_budget_s(ws) == 4230.0
    assert process_group_timeout_s(ws) == 4350.0


def test_the_budget_when_transfers_outlast_rollouts() -> None:
    ws = WeightSync(enabled=True, timeout_s=300.0, retries=2, rollout_timeout_s=60.0, engine_restarts=1,
                    engine_start_timeout_s=100.0, health_timeout_s=5.0)
    # per try max(60, 3 * 310 + 30 s retire = 960) = 960; 2 tries = 1920; one restart 105.
    assert rank0_wait_budget_s(ws) == 2025.0
    assert process_group_timeout_s(ws) == 2145.0


def test_short_budgets_keep_the_600_s_floor_and_no_sync_keeps_600() -> None:
    ws = WeightSync(enabled=True, timeout_s=5.0, retries=0, rollout_timeout_s=10.0, engine_restarts=0)
    assert rank0_wait_budget_s(ws) == 45.0  # 1 * (5 + 10) + 30 s retire
    assert process_group_timeout_s(ws) == 600.0
    assert process_group_timeout_s(WeightSync(enabled=False, rollout_timeout_s=9000.0)) == 600.0


class _Started(Exception):
    pass


def test_the_training_run_starts_its_process_group_with_the_derived_timeout(monkeypatch) -> None:
    import titan_lora.train as train

    seen = []

    def fake_init(device, timeout_s=None):
        seen.append(timeout_s)
        raise _Started

    monkeypatch.setattr(train, "init_distributed", fake_init)
    cfg = job_config_from(DEBUG_LORA + "[weight_sync]\nenabled = true\nrollout_timeout_s = 1000\n")
    with pytest.raises(_Started):
        train.TrainingRun(cfg)
    # per try max(1000, 4 * 130) = 1000; 4 tries + 3 * 610 = 5830; + 120 of slack
    assert seen == [5950.0]
