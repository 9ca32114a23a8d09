"""The training entry point as a user runs it: a SIGTERM mid-run (torchrun's, a scheduler's, `kill`)
stops the engine and leaves no shared memory behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from model_helpers import DEBUG_LORA
from shm_helpers import mapped_segments

REPO = Path(__file__).resolve().parents[1]
SYNCED_SFT = DEBUG_LORA + """
[engine]
kind = "receiver"
[weight_sync]
enabled = true
parity_every = 0
"""


def test_a_sigterm_mid_run_stops_the_engine_and_unlinks_the_shared_buffers(tmp_path: Path) -> None:
    config = tmp_path / "job.toml"
    config.write_text(SYNCED_SFT)
    log = tmp_path / "train.log"
    cmd = [sys.executable, "-m", "titan_lora.train", "--job.config_file", str(config),
           f"--job.dump_folder={tmp_path / 'run'}", "--training.steps=100000",
           f"--data.path={REPO / 'titan_lora/data/arith_sft.jsonl'}"]
    launcher = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")  # a user's shell has none
    env = {**{k: v for k, v in os.environ.items() if k not in launcher}, "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while "step    3/" not in log.read_text():  # mid-run: the engine holds our buffers, syncs go on
            assert proc.poll() is None, f"the job ended early:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no step 3 in 300 s:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        segments = {s for s in mapped_segments(proc.pid) if s.startswith("psm_")}
        engines = psutil.Process(proc.pid).children(recursive=True)
        assert segments and engines, "the trainer maps its gather buffer and runs the receiver"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    left = sorted(s for s in segments if os.path.exists(f"/dev/shm/{s}"))
    assert not left, f"shared memory left behind: {left}"
    _, alive = psutil.wait_procs(engines, timeout=30)
    assert not alive, f"engine processes outlived the trainer: {alive}"


def test_a_start_up_that_fails_after_the_engine_started_stops_the_engine(tmp_path: Path,
                                                                          monkeypatch) -> None:
    import pytest

    import titan_lora.train as train
    from titan_lora.trainer.job_config import job_config_from_toml

    started = []
    real_side = train.engine_side

    def side(*args):
        started.append(real_side(*args))
        return started[-1]

    def fail(*args) -> None:
        raise RuntimeError("the engine rejected our adapter")

    monkeypatch.setattr(train, "engine_side", side)
    monkeypatch.setattr(train, "build_sync", fail)
    cfg = job_config_from_toml(SYNCED_SFT, f"--job.dump_folder={tmp_path}",
                               f"--data.path={REPO / 'titan_lora/data/arith_sft.jsonl'}")
    with pytest.raises(RuntimeError, match="rejected our adapter"):
        train.TrainingRun(cfg)
    process = started[0].engine.proc
    assert process is not None and process.wait(timeout=30) is not None, "the embedded receiver was stopped"
