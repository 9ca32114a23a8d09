"""Several `[[adapters]]` export one PEFT folder each: on 2 FSDP ranks, a tiny random Qwen3 checkpoint (q/k
norms, RoPE rows permuted on export) with two adapters of different ranks, alphas and targets; each folder
loads in HF + peft on the same checkpoint and gives the trainer's logits for that adapter's rows (<= 1e-4),
with its own rank, alpha and targets in adapter_config.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from dist_helpers import run_ranks
from tiny_checkpoints import hf_model, hf_toml, tiny_qwen3

from titan_lora.lora.layer import adapter_params
from titan_lora.lora.multi_rows import AdapterRows, routed
from titan_lora.titan.lora_linear import fill_param

TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
TABLES = ('[[adapters]]\nname = "wide"\nrank = 8\nalpha = 16\n'
          '[[adapters]]\nname = "narrow"\nrank = 2\nalpha = 8\ntarget_modules = ["q_proj", "down_proj"]\n')
WANT = {"wide": (8, 16, ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]),
        "narrow": (2, 8, ["down_proj", "q_proj"])}


def _export_and_score(rank: int, world: int, toml: str, out: str) -> None:
    from model_helpers import build_from, job_config_from

    from titan_lora.compose import EngineSide, adapter_source

    built = build_from(toml)
    with torch.no_grad():  # every adapter non-zero, seeded, the same on any sharding
        for i, (_, param) in enumerate(adapter_params(built.model)):
            g = torch.Generator().manual_seed(100 + i)
            fill_param(param, torch.randn(param.shape, generator=g) * 0.05)
    logits = []
    with torch.no_grad():
        for k in range(2):  # every row through adapter k
            with routed(built.model, AdapterRows(tuple(len(TOKENS) if j == k else 0 for j in range(2)))):
                logits.append(built.model(TOKENS))
    adapter_source(job_config_from(toml), built, EngineSide()).export(out)
    if rank == 0:
        torch.save(logits, Path(out) / "titan_logits.pt")


def test_each_adapter_exports_a_peft_folder_that_hf_peft_serves_like_the_trainer(tmp_path: Path) -> None:
    from peft import PeftModel

    hf_dir = tiny_qwen3(tmp_path / "tiny_qwen3")
    toml = hf_toml("qwen3", hf_dir) + TABLES
    out = tmp_path / "exports"
    run_ranks(2, _export_and_score, toml, str(out))
    ours = torch.load(out / "titan_logits.pt")
    with torch.no_grad():
        base_logits = hf_model(hf_dir)(TOKENS).logits
    for k, name in enumerate(WANT):
        config = json.loads((out / name / "adapter_config.json").read_text())
        assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == WANT[name], config
        with torch.no_grad():
            theirs = PeftModel.from_pretrained(hf_model(hf_dir), str(out / name)).eval()(TOKENS).logits
        diff = (ours[k] - theirs).abs().max().item()
        assert (theirs - base_logits).abs().max().item() > 0.05, f"{name}: the adapter barely moves the logits"
        assert diff <= 1e-4, f"{name}: trainer vs HF + peft logits differ by {diff:.2e}"
    assert (ours[0] - ours[1]).abs().max().item() > 0.05, "the two adapters should differ"
