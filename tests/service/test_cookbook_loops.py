"""tinker-cookbook 0.6.1's minimal loops, unchanged, against a live `titan-lora serve` (SmolLM2-135M-Instruct
served as Qwen/Qwen3-4B-Instruct-2507, the hub replaced by local directories): sl_loop lowers its NLL, resumes
from its own checkpoint record; rl_loop raises its reward with importance_sampling, and runs with gspo. Long:
~12 minutes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cookbook_data import SERVED_NAME, write_cookbook_inputs
from test_tinker_sdk import KEY, ROOT, Service

from titan_lora.models.smollm2 import pretrained_dir

pytestmark = [pytest.mark.slow, pytest.mark.long]


def _loop(workdir: Path, url: str, recipe: str, *args: str, run: str = "") -> list[dict]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TINKER_TELEMETRY": "0",
           "TINKER_API_KEY": KEY}
    log = workdir / "runs" / (run or recipe)
    done = subprocess.run([sys.executable, "-m", f"tinker_cookbook.recipes.{recipe}", f"base_url={url}",
                           f"model_name={SERVED_NAME}", "save_every=0", "lora_rank=8", f"log_path={log}", *args],
                          cwd=workdir, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]


def test_the_cookbook_loops_run_unchanged(tmp_path: Path) -> None:
    pytest.importorskip("tinker_cookbook")
    write_cookbook_inputs(tmp_path, Path(pretrained_dir()), ROOT / "titan_lora/data/arith_sft.jsonl")
    service = Service(tmp_path / "service", "--service.base_model", SERVED_NAME)
    try:
        sft = _loop(tmp_path, service.url, "sl_loop", "batch_size=16", "max_steps=12", "learning_rate=1e-3")
        nll = [m["train_mean_nll"] for m in sft]
        assert len(nll) == 12 and max(nll[-3:]) < 0.25 * nll[0], nll
        record = json.loads((tmp_path / "runs/sl_loop/checkpoints.jsonl").read_text().splitlines()[-1])
        assert record["state_path"].endswith("/weights/final")
        assert record["sampler_path"].endswith("/sampler_weights/final")
        resumed = _loop(tmp_path, service.url, "sl_loop", "batch_size=16", "max_steps=12", "learning_rate=1e-3")
        assert len(resumed) == 12  # it found its checkpoint, loaded the state, and had nothing left to do
        rl = _loop(tmp_path, service.url, "rl_loop", "batch_size=4", "group_size=16", "max_tokens=48",
                   "max_steps=8", "learning_rate=1e-3", "loss_fn=importance_sampling")
        assert [m["progress/batch"] for m in rl] == list(range(8))
        reward = [m["reward/total"] for m in rl]
        # The loop's own metric: boxed, correct sums; the base model gets ~1% of them.
        assert sum(reward[-2:]) / 2 >= 0.3 and sum(reward[-2:]) / 2 > sum(reward[:2]) / 2 + 0.2, reward
        gspo = _loop(tmp_path, service.url, "rl_loop", "batch_size=8", "group_size=4", "max_tokens=32",
                     "max_steps=2", "learning_rate=5e-4", "loss_fn=gspo", run="rl_loop_gspo")
        assert [m["progress/batch"] for m in gspo] == [0, 1]
    finally:
        service.stop()
    published = [line for line in service.lines if "published" in line]
    assert len(published) >= 6, published  # sl: final; rl: one per batch and final
