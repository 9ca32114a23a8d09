"""scripts/bench_step.py runs end to end on CPU and prints the floor, the two LoRA rows (adapters sharded
by FSDP, adapters replicated) and the full row, the LoRA/full ratios and the phases of each step, and K
adapters in one step against K one-adapter steps."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.long  # a benchmark script run end to end: `pytest -m long`

ROOT = Path(__file__).resolve().parents[1]


def test_bench_step_prints_both_steps_and_their_ratio() -> None:
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_step.py"), "--device", "cpu", "--flavor", "debugmodel",
           "--seq-len", "64", "--steps", "2", "--warmup", "1", "--mixed-precision-param", "float32",
           "--optimizer-impl", "foreach", "--profile", "--phases", "--adapters", "3"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # 1 thread: no oversubscribed spin
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    names = ("floor: frozen base fwd+bwd, no optimizer", "LoRA step (adapters sharded by FSDP)",
             "LoRA step (adapters replicated)", "full fine-tuning step")
    rows = {name: re.search(rf"^{re.escape(name)}\s+([\d,]+)\s+([\d.]+)\s+([\d.]+)", text, re.M)
            for name in names}
    assert all(rows.values()), text
    trainable = {name: int(m.group(1).replace(",", "")) for name, m in rows.items()}
    floor, sharded, replicated, full = names
    assert trainable[floor] == 0
    assert 0 < trainable[sharded] == trainable[replicated] < trainable[full]
    p50 = {name: float(m.group(2)) for name, m in rows.items()}
    for lora in (sharded, replicated):
        ratio = re.search(rf"ratio {re.escape(lora)} / full \(p50\): ([\d.]+)", text)
        assert ratio, text
        assert abs(float(ratio.group(1)) - p50[lora] / p50[full]) < 0.01
    assert "6 layers" in text and "top-15 ops of one LoRA step" in text
    for lora in (sharded, replicated):
        phases = re.search(rf"^phases of {re.escape(lora)}, .*: (.*)$", text, re.M)
        assert phases, text
        times = dict(re.findall(r"(\w+) LoRA ([\d.]+) / full [\d.]+", phases.group(1)))
        assert set(times) == {"forward", "backward", "clip", "optimizer"}
        assert all(float(t) > 0 for t in times.values())
    # --adapters 3: three adapters of the replicated one's shape in one step of 3 rows, against 3 such steps
    multi = re.search(r"^3 adapters in one step \(3 x batch rows\)\s+([\d,]+)\s+([\d.]+)", text, re.M)
    assert multi, text
    assert int(multi.group(1).replace(",", "")) == 3 * trainable[replicated]
    gain = re.search(r"3 adapters in one step ([\d.]+) s vs 3 one-adapter steps ([\d.]+) s: ([\d.]+)x", text)
    assert gain, text
    assert float(gain.group(2)) == pytest.approx(3 * p50[replicated], abs=2e-4)
    assert float(gain.group(3)) == pytest.approx(float(gain.group(2)) / float(gain.group(1)), abs=0.01)
