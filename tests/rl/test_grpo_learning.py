"""The main job learns, survives engine faults, and a job SIGKILLed mid-run and relaunched repeats the
reference run exactly (torchrun, 2 ranks, the real SmolLM2-135M and a live vLLM engine).

One 10-step run of the shipped GRPO config serves all three tests. In steps 2 to 5 its embedded engine is
SIGKILLed in the middle of an adapter bucket, SIGKILLed while rollouts run, then its engine core alone is
frozen (SIGSTOP; the API server keeps answering) while rollouts run and again inside an adapter bucket:
the job must finish with one published version per step and the engine serving the trainer's adapter after
every restart, a wedged core found by the watchdog within 2 x health_timeout_s, not after the rollout
timeout (600 s here). Its held-out accuracy at steps 0 and 10 shows that it learns, and its per-step
rewards are the reference for a job resumed from its step-5 checkpoint, SIGKILLed during step 6, and
resumed again with the same command.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from dist_helpers import free_port
from job_helpers import in_flight, kill_tree, launch, scalars, shipped_config, wait_for, watched_engine
from process_helpers import engine_core_pid, engine_pid
from shm_helpers import shm_segments, unlink_orphaned

STEPS, RESUME_AT = 10, 5
# The shipped config (8 prompts x 8 samples, 8 new tokens, lr 2e-4, seed 0) with fewer prompts per step and
# a smaller held-out set, so that CI can afford it; held-out accuracy is measured at steps 0, 5 and 10, the
# parity probe at every step (after each engine restart too).
KEYS = {"steps": STEPS, "prompts_per_step": 2, "eval_size": 50, "eval_every": RESUME_AT,
        "interval": RESUME_AT, "parity_every": 1}
# Held-out accuracy (50 problems, greedy) at step 10 minus step 0. Measured: see docs/testing.md.
MIN_GAIN = 0.06
KEEP_VERSIONS = 2  # derived from the shipped [grpo] max_staleness = 1 (sync loop)
API_KEY = "learning-test-key"
HEALTH_TIMEOUT_S = 5
FAULTS = ["kill mid-bucket", "kill in rollouts", "core SIGSTOP in rollouts", "core SIGSTOP mid-bucket"]
REWARD_TAGS = ("rl/reward_mean", "rl/reward_std", "rl/response_len")
TRAINER_TAGS = ("train/loss", "train/grad_norm", "train/lr")
DOCUMENTED_TAGS = {
    "train/loss", "train/lr", "train/step_time_s", "train/memory_mib", "train/grad_norm",
    "rl/reward_mean", "rl/reward_std", "rl/response_len", "rl/logprob_gap_mean", "rl/logprob_gap_max",
    "rl/sample_version", "rl/dropped_stale", "rl/reward_errors", "eval/accuracy", "eval/failures",
    "train/nonfinite_rollbacks",
    "sync/gather_ms", "sync/pack_ms", "sync/transfer_ms", "sync/apply_ms", "sync/total_ms", "sync/bytes",
    "sync/tensors", "sync/version", "sync/live_versions", "sync/parity_max_abs", "sync/parity_mean_abs",
}


def compared(tags: dict[str, dict[int, float]], names: tuple[str, ...]) -> dict[str, dict[int, float | None]]:
    """`names` at every step after the resume; held-out accuracy at the resume step and the last."""
    after = range(RESUME_AT + 1, STEPS + 1)
    at = {tag: (RESUME_AT, STEPS) if tag == "eval/accuracy" else after for tag in names}
    return {tag: {s: tags.get(tag, {}).get(s) for s in steps} for tag, steps in at.items()}


def assert_one_version_per_step(tags: dict[str, dict[int, float]], steps: range) -> None:
    """Each step published one adapter version, sampled from the previous one, within 1e-3 of the trainer."""
    for step in steps:
        assert tags["sync/version"][step] == step, f"step {step}: one adapter version per optimizer step"
        assert tags["rl/sample_version"][step] == step - 1, f"step {step}: rollouts come from version s-1"
        assert tags["rl/logprob_gap_max"][step] < 1e-3, f"step {step}: rollouts not from the claimed version"
    assert max(tags["sync/live_versions"].values()) <= KEEP_VERSIONS + 1


def run_job(config: Path, log: Path, timeout_s: float = 1200) -> None:
    job = launch(config, log)
    try:
        rc = job.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(job.pid)
        job.wait()
        pytest.fail(f"the job did not finish in {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")
    assert rc == 0, log.read_text()[-3000:]


def kill_once_logged(config: Path, log: Path, line: str) -> None:
    """Launch the job and SIGKILL its whole tree (torchrun, ranks, engine) once `line` is logged, as an OOM
    killer or a lost node would; then unlink the shared-memory buffers it could not unlink itself."""
    segments_before = shm_segments()
    job = launch(config, log)
    try:
        wait_for(lambda: line in log.read_text(), repr(line), job, log, timeout_s=900, poll_s=0.2)
    finally:
        kill_tree(job.pid)  # torchrun's workers and the engine run in their own process groups
        job.wait()
    # Other jobs' segments are still mapped and stay.
    unlink_orphaned({n for n in shm_segments() - segments_before if n.startswith("psm_")})


@dataclasses.dataclass
class Reference:
    """The faulted reference run: its folder, TensorBoard scalars and log, the faults in the order they were
    made, and the time from each wedge to the next step's line."""

    dir: Path
    tags: dict[str, dict[int, float]]
    log: str
    faults: list[str]
    to_next_step: dict[str, float]


def run_with_engine_faults(tmp: Path) -> Reference:
    """The reference run, with a fault in each of steps 2 to 5 (before the step-5 checkpoint that the resume
    test starts from). The engine pauses 30 s in an adapter bucket whenever the test removed the marker
    file, which it writes again then (so one pause per removal)."""
    marker = tmp / "bucket-pause"
    marker.touch()  # disarmed
    port, log = free_port(), tmp / "run.log"
    config = watched_engine(shipped_config(tmp, "grpo.toml", **KEYS), port, API_KEY, HEALTH_TIMEOUT_S)
    job = launch(config, log, env={"TITAN_LORA_FAULT_BUCKET_PAUSE_S": "30",
                                   "TITAN_LORA_FAULT_MARKER": str(marker)})
    progress = lambda step: re.search(rf"^.*step\s+{step}/{STEPS} ", log.read_text(), re.M)  # noqa: E731
    busy = lambda: in_flight(port, API_KEY) > 0  # noqa: E731
    faults, to_next_step = [], {}
    try:
        # 1. SIGKILL inside an adapter bucket: armed after step 1, so the pause hits step 2's sync.
        wait_for(lambda: progress(1), "step 1", job, log)
        marker.unlink()
        wait_for(marker.exists, "a paused bucket", job, log, timeout_s=300)
        os.kill(engine_pid(job.pid), signal.SIGKILL)
        faults.append("kill mid-bucket")
        # 2. SIGKILL while step 3's rollouts are in flight.
        wait_for(lambda: progress(2), "step 2", job, log)
        wait_for(busy, "rollouts in flight", job, log, poll_s=0.01)
        os.kill(engine_pid(job.pid), signal.SIGKILL)
        faults.append("kill in rollouts")
        # 3. The engine core alone SIGSTOPped while step 4's rollouts are in flight: the API server answers
        # INFO and keeps the requests; only the watchdog's LIVE (a collective_rpc) sees the wedge.
        wait_for(lambda: progress(3), "step 3", job, log)
        wait_for(busy, "rollouts in flight", job, log, poll_s=0.01)
        os.kill(engine_core_pid(engine_pid(job.pid)), signal.SIGSTOP)
        wedged = time.monotonic()
        faults.append("core SIGSTOP in rollouts")
        wait_for(lambda: progress(4), "step 4", job, log)
        to_next_step["rollouts"] = time.monotonic() - wedged
        # 4. The engine core SIGSTOPped inside an adapter bucket of step 5's sync.
        marker.unlink()
        wait_for(marker.exists, "a paused bucket", job, log, timeout_s=300)
        os.kill(engine_core_pid(engine_pid(job.pid)), signal.SIGSTOP)
        wedged = time.monotonic()
        faults.append("core SIGSTOP mid-bucket")
        wait_for(lambda: progress(5), "step 5", job, log)
        to_next_step["bucket"] = time.monotonic() - wedged
        assert job.wait(timeout=1200) == 0, log.read_text()[-4000:]
    finally:
        if job.poll() is None:
            kill_tree(job.pid)
    return Reference(tmp, scalars(tmp / "run/tb"), log.read_text(), faults, to_next_step)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, smollm2_dir) -> Reference:
    """The one reference run of the module (engine faults in steps 2 to 5)."""
    return run_with_engine_faults(tmp_path_factory.mktemp("grpo_reference"))


@pytest.mark.slow
def test_default_grpo_job_learns(reference):
    """Held-out accuracy (greedy, exact match of the last integer) at step 10 beats step 0 by MIN_GAIN; the
    run logs every documented TensorBoard tag, one version per step, and the parity probe passes."""
    tags = reference.tags
    acc, rewards = tags["eval/accuracy"], tags["rl/reward_mean"]
    assert sorted(acc) == [0, RESUME_AT, STEPS], acc
    assert acc[STEPS] - acc[0] >= MIN_GAIN, f"held-out accuracy {acc}, sampled rewards {rewards}"
    missing = DOCUMENTED_TAGS - set(tags)
    assert not missing, f"TensorBoard lacks documented tags {sorted(missing)}"
    assert_one_version_per_step(tags, range(1, STEPS + 1))
    assert max(tags["sync/parity_max_abs"].values()) < 1e-3
    # Every engine incarnation (one start, four restarts) loaded the same SmolLM2 checkpoint: its base is
    # verified by digest once, never sent.
    assert max(tags["sync/base_verified"].values()) == 1 + len(FAULTS)
    assert max(tags["sync/base_sends"].values()) == 0


@pytest.mark.slow
def test_grpo_job_survives_kills_and_a_wedged_engine_core_in_rollouts_and_mid_bucket(reference):
    """Each fault was made, each wedged core found by the watchdog, each restart served the trainer's
    adapter: one published version per step, parity and the rollout log-prob gap < 1e-3 at every step."""
    print(f"\nfrom the wedge to the next step's line: {reference.to_next_step} "
          f"(health_timeout_s = {HEALTH_TIMEOUT_S})")
    assert reference.faults == FAULTS
    assert reference.log.count("starting titan_lora.engines.vllm_openai") == 5, "one start and four restarts"
    found = re.findall(r"failed its liveness check while .* was waiting on it \((\d+\.\d) s in\)",
                       reference.log)
    assert len(found) == 2, "each wedged core was found by the watchdog"
    # The watchdog's bound, plus an engine restart, the base's verification, the rest of the step and its
    # sync (about 40 s on 2 cores); far below the 600 s a rollout request would have waited.
    assert all(t < 120 for t in reference.to_next_step.values()), reference.to_next_step
    tags = reference.tags
    for step in range(1, STEPS + 1):
        assert tags["sync/version"][step] == step, f"step {step}: one published adapter version per step"
        assert tags["sync/parity_max_abs"][step] < 1e-3, f"step {step}: engine and trainer disagree"
        assert tags["rl/logprob_gap_max"][step] < 1e-3, f"step {step}: rollouts not from the claimed version"
    assert tags["sync/engine_recoveries"][STEPS] == len(FAULTS)


@pytest.mark.slow
def test_killed_and_resumed_runs_repeat_the_reference_rewards_exactly(reference, tmp_path):
    """The README's claim: resumed from a checkpoint with the same command, the adapter reaches the fresh
    engine before the first rollout, held-out accuracy at the resume step reads the same, and the rewards of
    the later steps repeat the first attempt's exactly. The first job starts on a copy of the step-5
    checkpoint and is SIGKILLed during step 6; the same command then resumes from step 5 again."""
    ref_dir, ref = reference.dir, reference.tags
    ckpt = Path("run/checkpoint") / f"step-{RESUME_AT}"
    shutil.copytree(ref_dir / ckpt, tmp_path / ckpt)
    config = shipped_config(tmp_path, "grpo.toml", **KEYS)
    # Once it logged the resume step's held-out accuracy it is in step 6's rollouts.
    kill_once_logged(config, tmp_path / "killed.log", f"held-out accuracy at step {RESUME_AT}:")
    # The checkpoints on disk, not the log: the kill can land between a write and its log line.
    complete = (tmp_path / "run/checkpoint").glob("step-*/.metadata")
    assert [p.parent.name for p in complete] == [f"step-{RESUME_AT}"], "the killed job wrote no checkpoint"

    log = tmp_path / "resumed.log"
    run_job(config, log)
    text = log.read_text()
    assert f"starting at step {RESUME_AT}" in text
    assert re.search(rf"^step\s+{RESUME_AT + 1}/{STEPS} ", text, re.M), text[-2000:]

    got = scalars(tmp_path / "run/tb")  # both jobs' event files; the later job's values win
    assert min(got["rl/reward_mean"]) == RESUME_AT + 1
    assert got["rl/sample_version"][RESUME_AT + 1] == RESUME_AT, "the first rollouts used the resumed adapter"
    assert_one_version_per_step(got, range(RESUME_AT + 1, STEPS + 1))
    claimed = ("eval/accuracy", *REWARD_TAGS)
    assert compared(got, claimed) == compared(ref, claimed)
    # Beyond the README's claim, and what the rewards alone could miss (seeded sampling often draws the
    # same tokens from slightly different weights): the adapter, optimizer and LR state came back exactly.
    assert compared(got, TRAINER_TAGS) == compared(ref, TRAINER_TAGS)
    assert (tmp_path / "run/adapter/adapter_model.safetensors").exists()


def test_heldout_answers_are_the_arithmetic_of_their_questions():
    """The accuracy oracle: every problem's answer is what its question asks, computed here from the text."""
    from titan_lora.rl.task import train_and_heldout
    from titan_lora.rl.tasks import ArithTask

    train, held = train_and_heldout(ArithTask(), 2000, 100, seed=0)
    for p in train + held:
        a, op, b = re.fullmatch(r"What is (\d+) ([+-]) (\d+)\?", p.question).groups()
        assert p.answer == (int(a) + int(b) if op == "+" else int(a) - int(b)), p
