"""Two GRPO steps on 2 ranks with a JSONL task written here (debug model, no engine: `[grpo] rollouts =
false`), through the CLI as a user runs it, ending in a PEFT adapter exported under the dump folder by
default and a last line saying where."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]

CONFIG = """
[job]
dump_folder = "{tmp}/run"
[model]
name = "smollm2"
flavor = "debug"
converters = ["lora"]
[lora]
rank = 4
alpha = 8
[grpo]
enabled = true
rollouts = false
task = "jsonl"
prompts_per_step = 2
group_size = 2
eval_every = 0
[task]
path = "{tmp}/train.jsonl"
heldout_path = "{tmp}/test.jsonl"
extract = "boxed"
instruction = "Put the final answer in \\\\boxed{{}}."
[optimizer]
lr = 1e-3
[training]
steps = 2
seq_len = 128
mixed_precision_param = "float32"
[activation_checkpoint]
mode = "none"
[checkpoint]
enable = false
"""


def test_two_grpo_steps_on_a_jsonl_task_run_and_export(tmp_path: Path) -> None:
    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i), "system": "Be brief."} for i in range(12)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:8]))
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[8:]))
    config = tmp_path / "jsonl.toml"
    config.write_text(CONFIG.format(tmp=tmp_path))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "titan_lora.train",
           "--job.config_file", str(config)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    adapter = tmp_path / "run" / "adapter"  # [lora] export_dir left out: the default, under the dump folder
    said = [line for line in proc.stderr.splitlines() if "the trained adapter" in line]
    assert len(said) == 1 and said[0].endswith(f" is in {adapter}"), proc.stderr[-3000:]  # rank 0, once
    peft = json.loads((adapter / "adapter_config.json").read_text())
    assert peft["r"] == 4 and peft["lora_alpha"] == 8
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    # Two optimizer steps moved lora_B off its zero init (the samples: the data's answers and wrong ones).
    assert any(name.endswith("lora_B.weight") and t.abs().max() > 0 for name, t in tensors.items())


def test_a_bad_line_stops_the_cli_before_anything_is_built(tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n{"prompt": "x"}\n')
    (tmp_path / "test.jsonl").write_text('{"prompt": "What is 2 + 2?", "answer": "4"}\n')
    config = tmp_path / "jsonl.toml"
    config.write_text(CONFIG.format(tmp=tmp_path))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "titan_lora.train", "--job.config_file", str(config)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f'titan_lora: config error: {tmp_path}/train.jsonl:2: no "answer" (keys: prompt); each line' in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()
