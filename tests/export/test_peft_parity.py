"""SmolLM2 + a non-zero adapter on 2 FSDP ranks == HF LlamaForCausalLM + our exported adapter in peft."""

from __future__ import annotations

import json

import pytest
import torch
from dist_helpers import run_ranks
from model_helpers import SMOLLM2_LORA, build_from, job_config_from, randomize_adapters

from titan_lora.export.peft import peft_config, save_peft_dir, to_peft_names
from titan_lora.lora.layer import adapter_params, lora_modules
from titan_lora.lora.targets import hf_leaf_names
from titan_lora.models.llama3 import LLAMA3
from titan_lora.sync.gather import ShardGatherer

TOKENS = torch.randint(0, 49152, (2, 48), generator=torch.Generator().manual_seed(0))


def _export_and_score(rank: int, world: int, out_dir: str, toml: str) -> None:
    built = build_from(toml)
    randomize_adapters(built.model)
    gathered = ShardGatherer(adapter_params(built.model)).gather()
    with torch.no_grad():
        logits = built.model(TOKENS)
    if rank == 0:
        targets = hf_leaf_names([n for n, _ in lora_modules(built.model)], LLAMA3.leaf_names)
        lora_cfg = job_config_from(toml).lora
        save_peft_dir(out_dir, to_peft_names(gathered, built.peft_layout), peft_config(lora_cfg, targets))
        torch.save(logits, f"{out_dir}/titan_logits.pt")


@pytest.mark.slow
@pytest.mark.parametrize("toml", [SMOLLM2_LORA, SMOLLM2_LORA.replace("alpha = 16", "alpha = 4\nuse_rslora = true")])
def test_fsdp2_adapter_matches_hf_peft(tmp_path, smollm2_dir, toml):
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    run_ranks(2, _export_and_score, str(tmp_path), toml)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    base = LlamaForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    with torch.no_grad():
        base_logits = base(TOKENS).logits
        hf = PeftModel.from_pretrained(base, str(tmp_path)).eval()
        hf_logits = hf(TOKENS).logits
    ours = torch.load(tmp_path / "titan_logits.pt")
    diff = (ours - hf_logits).abs().max().item()
    effect = (hf_logits - base_logits).abs().max().item()
    print(f"max |titan - hf+peft| = {diff:.2e}; adapter moved logits by up to {effect:.2f}")
    assert effect > 0.1, "the adapter should change the logits, or this test proves nothing"
    assert diff <= 1e-4
