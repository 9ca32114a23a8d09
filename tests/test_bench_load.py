"""scripts/bench_load.py runs end to end on CPU (2 gloo ranks, TP=2, a checkpoint of several files) and prints
the floor, both loads and their ratios to the goals."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.long  # a benchmark script run end to end: `pytest -m long`

ROOT = Path(__file__).resolve().parents[1]


def test_bench_load_prints_the_floor_and_both_loads(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_load.py"), "--device", "cpu", "--shape", "tiny",
           "--ranks", "2", "--tp", "2", "--shard-gb", "0.0005", "--no-drop", "--dir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert any("files; 2 ranks (cpu, tp 2)" in line and " 1 files" not in line for line in lines), out.stdout
    for label in ("floor:", "old: full read", "new: slices"):
        assert any(line.startswith(label) for line in lines), f"no {label!r} row in:\n{out.stdout}"
    assert not list(tmp_path.iterdir()), "the checkpoint was left behind"
