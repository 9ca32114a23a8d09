"""Each family on 2 FSDP ranks, a tiny random HF checkpoint loaded by `[model] hf_assets_path`, a non-zero
adapter on every linear: torchtitan's log-probs == HF + peft loading our export (fp32, <= 1e-4).

Llama (GQA, tied head, sharded with an index) needs the RoPE row permutation of wq/wk lora_B; Qwen3
(q/k norms, head_dim 32 != 64 / 4) needs none: torchtitan's Qwen3 is rotate-half like HF. A tied Qwen3 ties
its head in memory too (one parameter), which FSDP must shard in one group.
A wrong layout for either family moves the log-probs by far more than the bound.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_helpers import run_ranks
from model_helpers import build_from, job_config_from, randomize_adapters
from tiny_checkpoints import hf_model, hf_toml, tiny_llama, tiny_qwen3

from titan_lora.sync.adapter_source import AdapterSource

TOKENS = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
CASES = {
    "llama3-gqa-tied-sharded": ("llama3", lambda out: tiny_llama(out, tied=True, shard_mb=0.05)),
    "qwen3-qknorm-headdim32-untied": ("qwen3", lambda out: tiny_qwen3(out, tied=False)),
    "qwen3-tied": ("qwen3", lambda out: tiny_qwen3(out, tied=True)),
}


def _export_and_score(rank: int, world: int, toml: str, out_dir: str) -> None:
    built = build_from(toml)
    randomize_adapters(built.model, std=0.1)
    AdapterSource(built.model, built.peft_layout, job_config_from(toml).lora).export(out_dir)  # collective
    with torch.no_grad():
        log_probs = built.model(TOKENS).log_softmax(-1)
    if rank == 0:
        torch.save(log_probs, Path(out_dir).parent / "titan_log_probs.pt")


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_fsdp2_adapter_matches_hf_peft_for_each_family(tmp_path: Path, case: str) -> None:
    from peft import PeftModel

    name, make = CASES[case]
    hf_dir = make(tmp_path / "hf")
    run_ranks(2, _export_and_score, hf_toml(name, hf_dir), str(tmp_path / "adapter"))
    hf = hf_model(hf_dir)
    with torch.no_grad():
        base = hf(TOKENS).logits.log_softmax(-1)
        theirs = PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()(TOKENS).logits.log_softmax(-1)
    ours = torch.load(tmp_path / "titan_log_probs.pt")
    diff, effect = (ours - theirs).abs().max().item(), (theirs - base).abs().max().item()
    print(f"{case}: max |log_softmax titan - hf+peft| = {diff:.2e}; adapter effect {effect:.2f}")
    assert effect > 0.5, f"the adapter moved the log-probs by only {effect:.3f}: this test would prove nothing"
    assert diff <= 1e-4, f"{case}: max |log_softmax titan - hf+peft| = {diff:.2e} (adapter effect {effect:.2f})"
