"""Helpers for the slow tests that run the main GRPO job through its CLI (torchrun, 2 ranks)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHIPPED_GRPO = REPO / "train_configs/smollm2_grpo_arith.toml"


def shipped_config(tmp: Path, name: str, source: Path = SHIPPED_GRPO, **keys: object) -> Path:
    """A shipped GRPO config (`source`: the main job's by default) writing under `tmp/run` (its adapter under
    `tmp/run/adapter`, the default), with each `key = value` line given in `keys` replaced."""
    text = source.read_text()
    for key, value in {"dump_folder": f'"{tmp}/run"', **keys}.items():
        text, n = re.subn(rf"^{key} = .*$", f"{key} = {value}", text, flags=re.M)
        assert n == 1, f"{key} not found once in the shipped config"
    path = tmp / name
    path.write_text(text)
    return path


def short_config(tmp: Path, steps: int) -> Path:
    """The shipped GRPO config, made small enough for CI: no checkpoints (the fault tests that use it do
    not resume; a save costs a few seconds a step on 2 cores)."""
    return shipped_config(tmp, f"grpo_{steps}.toml", prompts_per_step=2, group_size=4, max_new_tokens=4,
                          eval_size=6, eval_every=2, parity_every=1, steps=steps, enable="false")


HOLD_ENV = "TITAN_LORA_TEST_HOLD"
LENGTH_REWARD = f"""
import os
import time


def by_length(completion, problem):
    hold = os.environ.get("{HOLD_ENV}")
    while hold and os.path.exists(hold):
        time.sleep(0.05)
    return len(completion) / 100
"""
"""A reward plug-in for random models, which never answer right: completion lengths differ, so every group
has an advantage to learn from and the adapter moves at every step. While the file named by `HOLD_ENV`
exists the job waits in its rewards (rank 0, between rollouts and training): a test paces a job whose
steps take a second, so that what runs beside training (a replica's revival) lands inside the run."""


def on_tiny_model(config: Path, smollm2_dir: Path) -> dict[str, str]:
    """`config` rewritten to train a tiny random Qwen3 made here (2 layers, SmolLM2's tokenizer), rewarded by
    completion length; the environment that finds the reward. For the fault tests: a step takes about a
    second instead of SmolLM2's 30 on 2 cores, and the engine faults, recoveries and data paths are the same
    code. The job learning a task stays on SmolLM2 (test_grpo_learning.py)."""
    from tiny_checkpoints import SMOLLM2_VOCAB, tiny_qwen3

    tmp = config.parent
    (tmp / "length_reward.py").write_text(LENGTH_REWARD)
    on_checkpoint(config, "qwen3", tiny_qwen3(tmp / "tiny_qwen3", vocab=SMOLLM2_VOCAB, tokenizer_from=smollm2_dir),
                  {r"^reward = .*$": 'reward = "length_reward:by_length"'})
    return {"PYTHONPATH": os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")])}


def on_checkpoint(config: Path, family: str, hf_dir: Path, more: dict[str, str] | None = None) -> None:
    """`config` (a shipped SmolLM2 job) rewritten to train `family` from the checkpoint in `hf_dir`, with the
    engine's length the model's own positions and each line matching a pattern of `more` replaced."""
    text = config.read_text()
    for pattern, line in ((r'^name = "smollm2"$', f'name = "{family}"\nhf_assets_path = "{hf_dir}"'),
                          (r"^flavor = .*\n", ""), (r"^\[engine\]$", "[engine]\nmax_model_len = 256"),
                          *(more or {}).items()):
        text, n = re.subn(pattern, line, text, count=1, flags=re.M)
        assert n == 1, f"{pattern} not found in {config}"
    config.write_text(text)


def watched_engine(config: Path, port: int, api_key: str, health_timeout_s: float) -> Path:
    """`config` with its engine on `port` behind `api_key` (so that a test can see its requests in flight),
    rollout requests allowed 600 s and the liveness watch bounded by `health_timeout_s`: only the watch can
    find a wedged engine core in time."""
    text = config.read_text()
    text = re.sub(r"^port = .*$", f'port = {port}\napi_key = "{api_key}"', text, count=1, flags=re.M)
    timeouts = f"rollout_timeout_s = 600\nhealth_timeout_s = {health_timeout_s}\n"
    text = re.sub(r"^\[weight_sync\]\n", "[weight_sync]\n" + timeouts, text, flags=re.M)
    config.write_text(text)
    return config


def launch(config: Path, log: Path, entry: tuple[str, ...] = ("-m", "titan_lora.train"),
           env: dict[str, str] | None = None) -> subprocess.Popen:
    """torchrun the job (`entry`: the module, or a script wrapping it) in its own process group (so a kill
    takes the engine down too), with `env` added to the environment."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *entry,
           "--job.config_file", str(config)]
    return subprocess.Popen(cmd, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def run_job(config: Path, log: Path, timeout_s: float = 1200, env: dict[str, str] | None = None) -> None:
    """Launch the job and wait for it; fail with its log's end if it fails or outlasts `timeout_s`."""
    import pytest

    job = launch(config, log, env=env)
    try:
        rc = job.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(job.pid)
        job.wait()
        pytest.fail(f"the job did not finish in {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")
    assert rc == 0, log.read_text()[-3000:]


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant, as an OOM killer or a lost node would."""
    import psutil

    parent = psutil.Process(pid)
    for proc in [*parent.children(recursive=True), parent]:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def kill_and_resume(job: subprocess.Popen, config: Path, log: Path, env: dict[str, str],
                    segments_before: set[str]) -> tuple[str, subprocess.Popen]:
    """`kill_job_but_its_engine`, then the shared-memory buffers the killed job could not unlink, then the
    same job launched again (it resumes from its newest checkpoint): (the first run's log, the new job)."""
    from shm_helpers import shm_segments, unlink_orphaned

    kill_job_but_its_engine(job)
    first = log.read_text()
    unlink_orphaned({n for n in shm_segments() - segments_before if n.startswith("psm_")})
    return first, launch(config, log, env=env)


def kill_job_but_its_engine(job: subprocess.Popen) -> None:
    """SIGKILL every process of the job but its engine (torchrun, ranks), as an OOM killer or a lost node
    would; the engine (vLLM's API server and engine core, in their own session, maybe decoding) must end by
    its own parent-death wiring within 5 s, though a graceful shutdown would wait for the running requests."""
    import psutil
    from process_helpers import engine_pid

    engine: list[psutil.Process] = []
    try:
        server = psutil.Process(engine_pid(job.pid))
        engine = [server, *server.children(recursive=True)]
        names = [" ".join(p.cmdline()) for p in engine]
        assert any("EngineCore" in n for n in names), f"no vLLM engine core among {names}"
        for proc in [*psutil.Process(job.pid).children(recursive=True), psutil.Process(job.pid)]:
            if proc not in engine:
                proc.kill()
        job.wait()
        ended = time.monotonic() + 5
        while (left := [p for p in engine if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]):
            assert time.monotonic() < ended, f"engine processes outlived their job by 5 s: {left}"
            time.sleep(0.1)
    finally:
        if job.poll() is None:
            kill_tree(job.pid)
            job.wait()
        for proc in engine:
            with contextlib.suppress(psutil.Error):
                proc.kill()


def scalars(tb: Path) -> dict[str, dict[int, float]]:
    """tag -> step -> value over every event file under `tb`."""
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


def wait_for(predicate, what: str, job, log: Path, timeout_s: float = 600, poll_s: float = 0.05) -> None:
    """Poll `predicate` until true; fail with the log's end if the job ends or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert job.poll() is None, f"the job ended while waiting for {what}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {what} in {timeout_s:.0f} s:\n{log.read_text()[-4000:]}"
        time.sleep(poll_s)


def in_flight(port: int, api_key: str) -> int:
    """Generate requests the engine on `port` is serving now (0 when it does not answer)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/titan/info", data=b"{}", method="POST",
                                 headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=2) as resp:
            return sum(json.loads(resp.read())["in_flight"].values())
    except OSError:
        return 0
