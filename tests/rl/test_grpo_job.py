"""The main job, short: GRPO with rollouts from a live vLLM engine, killed and resumed (torchrun, 2 ranks)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCUMENTED_TAGS = {
    "train/loss", "train/lr", "train/step_time_s", "train/memory_mib", "train/grad_norm",
    "rl/reward_mean", "rl/reward_std", "rl/response_len", "rl/logprob_gap_mean", "rl/logprob_gap_max",
    "rl/sample_version", "rl/dropped_stale", "eval/accuracy", "eval/failures", "train/nonfinite_rollbacks",
    "sync/gather_ms", "sync/pack_ms", "sync/transfer_ms", "sync/apply_ms", "sync/total_ms", "sync/bytes",
    "sync/tensors", "sync/version", "sync/live_versions", "sync/parity_max_abs", "sync/parity_mean_abs",
}


def short_config(tmp: Path, steps: int) -> Path:
    """The shipped GRPO config, made small enough for CI."""
    text = (REPO / "train_configs/smollm2_grpo_arith.toml").read_text()
    for old, new in [
        (r'dump_folder = ".*"', f'dump_folder = "{tmp}/run"'),
        (r'export_dir = ".*"', f'export_dir = "{tmp}/adapter"'),
        (r"prompts_per_step = \d+", "prompts_per_step = 2"), (r"group_size = \d+", "group_size = 4"),
        (r"max_new_tokens = \d+", "max_new_tokens = 4"), (r"eval_size = \d+", "eval_size = 6"),
        (r"eval_every = \d+", "eval_every = 2"), (r"parity_every = \d+", "parity_every = 1"),
        (r"steps = \d+", f"steps = {steps}"), (r"interval = \d+", "interval = 1"),
    ]:
        text, n = re.subn(rf"^{old}", new, text, flags=re.M)
        assert n == 1, f"{old} not found once in the shipped config"
    path = tmp / f"grpo_{steps}.toml"
    path.write_text(text)
    return path


def launch(config: Path, log: Path) -> subprocess.Popen:
    """torchrun the job in its own process group (so a kill takes the engine down too)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "titan_lora.train",
           "--job.config_file", str(config)]
    return subprocess.Popen(cmd, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant, as an OOM killer or a lost node would."""
    import psutil

    parent = psutil.Process(pid)
    for proc in [*parent.children(recursive=True), parent]:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def shm_segments() -> set[str]:
    """The POSIX shared-memory segments on this host."""
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def scalars(tb: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    mux = EventMultiplexer()
    for f in sorted(tb.glob("events.*")):  # one file per run (the killed one and the resumed one)
        mux.AddRun(str(f), name=f.name)
    mux.Reload()
    out: dict[str, dict[int, float]] = {}
    for run in mux.Runs():
        for tag in mux.Runs()[run]["scalars"]:
            for e in mux.Scalars(run, tag):
                out.setdefault(tag, {})[e.step] = e.value
    return out


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
    for name in shm_segments() - segments_before:  # a killed process cannot unlink its buffers
        if name.startswith("psm_"):
            os.unlink(os.path.join("/dev/shm", name))

    log2 = tmp_path / "run2.log"
    resumed = launch(short_config(tmp_path, steps=4), log2)
    assert resumed.wait(timeout=900) == 0, log2.read_text()[-3000:]
    text = log2.read_text()
    killed_at = max(int(s) for s in re.findall(r"saved checkpoint .*step-(\d+)", log1.read_text()))
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
