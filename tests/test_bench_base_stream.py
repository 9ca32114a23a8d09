"""scripts/bench_base_stream.py runs end to end on CPU (2 gloo ranks, the receiver as the engine) and prints the
floor, the baseline, the streamed base and the job's steps with one version each."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.long  # a benchmark script run end to end: `pytest -m long`

ROOT = Path(__file__).resolve().parents[1]


def test_bench_base_stream_prints_the_floor_the_baseline_and_the_streamed_base(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_base_stream.py"), "--device", "cpu", "--shape", "tiny",
           "--ranks", "2", "--steps", "2", "--dir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    for label in ("floor: all-gather", "baseline: whole state dict", "base streamed from the shards",
                  "baseline: rank 0 peak RSS", "job: largest rank peak RSS", "job: receiver peak RSS"):
        assert any(line.startswith(label) for line in lines), f"no {label!r} row in:\n{out.stdout}"
    assert re.search(r"\(21 tensors;", out.stdout), "the whole base (21 tensors of the tiny shape) was streamed"
    assert "job: versions [1, 2];" in out.stdout, out.stdout
    assert not list(tmp_path.iterdir()), "the checkpoint was left behind"
