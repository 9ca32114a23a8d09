"""The main job, short: GRPO with rollouts from a live vLLM engine, killed and resumed (torchrun, 2 ranks)."""

from __future__ import annotations

import re
import time

import pytest
from job_helpers import kill_tree, launch, scalars, short_config
from shm_helpers import shm_segments, unlink_orphaned

DOCUMENTED_TAGS = {
    "train/loss", "train/lr", "train/step_time_s", "train/memory_mib", "train/grad_norm",
    "rl/reward_mean", "rl/reward_std", "rl/response_len", "rl/logprob_gap_mean", "rl/logprob_gap_max",
    "rl/sample_version", "rl/dropped_stale", "eval/accuracy", "eval/failures", "train/nonfinite_rollbacks",
    "sync/gather_ms", "sync/pack_ms", "sync/transfer_ms", "sync/apply_ms", "sync/total_ms", "sync/bytes",
    "sync/tensors", "sync/version", "sync/live_versions", "sync/parity_max_abs", "sync/parity_mean_abs",
}


@pytest.mark.slow
def test_grpo_job_kill_and_resume(tmp_path, smollm2_dir):
    log1 = tmp_path / "run1.log"
    segments_before = shm_segments()
    job = launch(short_config(tmp_path, steps=6), log1)
    deadline = time.monotonic() + 900
    ckpt = tmp_path / "run/checkpoint/step-2/.metadata"
    while not ckpt.exists():  # kill it once step 2's checkpoint is complete
        assert job.poll() is None, f"job ended early:\n{log1.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "no step-2 checkpoint in 15 minutes"
        time.sleep(1)
    kill_tree(job.pid)  # torchrun's workers and the engine run in their own process groups
    job.wait()
    # A killed process cannot unlink its buffers; other jobs' segments are still mapped and stay.
    unlink_orphaned({n for n in shm_segments() - segments_before if n.startswith("psm_")})

    # The checkpoint on disk, not the log: the kill can land between the write and its log line.
    complete = (tmp_path / "run/checkpoint").glob("step-*/.metadata")
    killed_at = max(int(p.parent.name.removeprefix("step-")) for p in complete)

    log2 = tmp_path / "run2.log"
    resumed = launch(short_config(tmp_path, steps=4), log2)
    assert resumed.wait(timeout=900) == 0, log2.read_text()[-3000:]
    text = log2.read_text()
    assert f"starting at step {killed_at}" in text
    assert re.search(rf"^step\s+{killed_at + 1}/4 ", text, re.M), text[-2000:]

    tags = scalars(tmp_path / "run/tb")
    missing = DOCUMENTED_TAGS - set(tags)
    assert not missing, f"TensorBoard lacks documented tags {sorted(missing)}"
    for step in range(1, 5):
        assert tags["sync/version"][step] == step, "one adapter version per optimizer step"
        assert tags["rl/sample_version"][step] == step - 1, "rollouts of step s come from version s-1"
        assert tags["rl/logprob_gap_max"][step] < 1e-3, "rollouts were not produced by the version they claim"
    assert max(tags["sync/parity_max_abs"].values()) < 1e-3
    assert max(tags["sync/live_versions"].values()) <= 3  # keep_versions + 1
    assert (tmp_path / "adapter/adapter_model.safetensors").exists()
