"""Checkpoints of a job with several `[[adapters]]`: keyed by adapter name (never by table index), a job
resumed from the step-3 checkpoint of a 6-step run ends on that run's weights exactly, and a resume with the adapters renamed, reordered, reshaped, or by a
one-adapter job is refused as the job loads, naming the difference, before anything is built."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_helpers import run_ranks
from model_helpers import DEBUG_SFT, full_copy, job_config_from

from titan_lora.lora.layer import adapter_params
from titan_lora.trainer.checkpoint import SIGNATURE_FILE

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "titan_lora/data/arith_sft.jsonl"
A = f'[[adapters]]\nname = "math"\nrank = 4\nlr = 2e-3\ndata_seed = 1\ndata_path = "{DATA}"\n'
B = '[[adapters]]\nname = "chat"\nrank = 2\ntarget_modules = ["wq", "wo"]\nlr = 5e-4\n'
JOB = DEBUG_SFT + """
[checkpoint]
enable = true
interval = 3
"""


def _train(rank: int, world: int, tables: str, dump: str, steps: int, out: str) -> None:
    from titan_lora.train import TrainingRun

    cfg = job_config_from(JOB + tables, f"--job.dump_folder={dump}", "--training.global_batch_size=4",
                          "--training.local_batch_size=4", f"--training.steps={steps}", "--lora.export_dir=")
    run = TrainingRun(cfg)
    try:
        start = run.step
        run.train()
        if rank == 0:
            torch.save({"start": start, "weights": {n: full_copy(p) for n, p in adapter_params(run.model)}}, out)
    finally:
        run.close()


def test_a_resumed_job_with_several_adapters_repeats_the_uninterrupted_run(tmp_path: Path) -> None:
    run_ranks(1, _train, A + B, str(tmp_path / "whole"), 6, str(tmp_path / "whole.pt"))
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "whole/checkpoint/step-3", resumed / "checkpoint/step-3")
    run_ranks(1, _train, A + B, str(resumed), 6, str(tmp_path / "resumed.pt"))
    whole, again = torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "resumed.pt")
    assert (whole["start"], again["start"]) == (0, 3)
    whole, again = whole["weights"], again["weights"]
    assert sorted(whole) == sorted(again)
    diff = max(float((whole[n] - again[n]).abs().max()) for n in whole)
    assert diff == 0.0, f"the resumed run differs from the uninterrupted one by {diff:.2e}"

    # Stored by adapter name and one-adapter PEFT name; the signature lists each adapter.
    step3 = resumed / "checkpoint/step-3"
    keys = dcp.FileSystemReader(str(step3)).read_metadata().state_dict_metadata
    stored = {k.split(".", 1)[1].split("/", 1)[0] for k in keys if k.startswith("adapter.")}
    assert stored == {"math", "chat"}, sorted(keys)[:4]
    assert "adapter.chat/base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    signature = json.loads((step3 / SIGNATURE_FILE).read_text())
    assert [(a["name"], a["lora_rank"], a["target_modules"]) for a in signature["adapters"]] == [
        ("math", 4, signature["adapters"][0]["target_modules"]),
        ("chat", 2, ["model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.q_proj",
                     "model.layers.1.self_attn.o_proj", "model.layers.1.self_attn.q_proj"])]

    renamed = B.replace('"chat"', '"code"')
    for tables, match in [
        (B + A, r"its adapters are in the order \['math', 'chat'\], this job's tables in \['chat', 'math'\]"),
        (A + renamed, r"added \['code'\], removed \['chat'\]"),
        (A + B.replace("rank = 2", "rank = 8"), r"the adapters \['chat'\] have another rank or other target_modules"),
        ("", r"saved by a job with the adapters \['math', 'chat'\], this job has one adapter"),
    ]:  # refused as the job loads, before anything is built
        with pytest.raises(ValueError, match=match):
            job_config_from(JOB + tables, f"--job.dump_folder={resumed}", "--training.global_batch_size=4",
                            "--training.local_batch_size=4", "--training.steps=9", "--lora.export_dir=")
