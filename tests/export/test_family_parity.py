"""Each family on 2 FSDP ranks, a tiny random HF checkpoint loaded by `[model] hf_assets_path`, a non-zero
adapter on every linear: torchtitan's log-probs == HF + peft loading our export (fp32, <= 1e-4).

Llama (GQA, tied head, sharded with an index) needs the RoPE row permutation of wq/wk lora_B; Qwen3
(q/k norms, head_dim 32 != 64 / 4) needs none: torchtitan's Qwen3 is rotate-half like HF. A tied Qwen3 ties
its head in memory too (one parameter), which FSDP must shard in one group.
A wrong layout for either family moves the log-probs by far more than the bound.

With `pytest -m gpu` the Llama and untied Qwen3 cases also run under TP=2 on 2 GPUs and TP=2 x FSDP=2 on
4 GPUs (NCCL): placements per the base's plan, then the export against HF + peft (CPU, fp32) in fp32
(<= 1e-4, TF32 off) and under bf16 autocast (<= 0.1, at least 5x under the adapter's effect: bf16 keeps
8 bits of mantissa). Qwen3's TP forward runs only here (DTensor has no rule for CPU attention), and in
bf16 only: in fp32 with GQA only SDPA's math kernel applies, which DTensor cannot shard under
torchtitan's Qwen3 TP plan.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_helpers import needs_gpus, run_ranks
from model_helpers import (
    TP2,
    TP2_FSDP2,
    build_from,
    check_tp2_placements,
    full_copy,
    job_config_from,
    randomize_adapters,
)
from tiny_checkpoints import hf_model, hf_toml, tiny_llama, tiny_qwen3

from titan_lora.sync.adapter_source import AdapterSource

TOKENS = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
CASES = {
    "llama3-gqa-tied-sharded": ("llama3", lambda out: tiny_llama(out, tied=True, shard_mb=0.05)),
    "qwen3-qknorm-headdim32-untied": ("qwen3", lambda out: tiny_qwen3(out, tied=False)),
    "qwen3-tied": ("qwen3", lambda out: tiny_qwen3(out, tied=True)),
}


BF16_BOUND = 0.1


def _export_and_score(rank: int, world: int, toml: str, out_dir: str, fp32: bool, *overrides: str) -> None:
    built = build_from(toml, *overrides)
    if overrides in (TP2, TP2_FSDP2):
        check_tp2_placements(built.model)
    randomize_adapters(built.model, std=0.1)
    AdapterSource(built.model, built.peft_layout, job_config_from(toml).lora).export(out_dir)  # collective
    tokens = TOKENS.to(next(built.model.parameters()).device)
    with torch.no_grad():
        # full_copy: vocab-sharded under TP
        scores = {"fp32": full_copy(built.model(tokens)).log_softmax(-1)} if fp32 else {}
        if tokens.is_cuda:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                scores["bf16"] = full_copy(built.model(tokens)).float().log_softmax(-1)
    if rank == 0:
        torch.save(scores, Path(out_dir).parent / "titan_log_probs.pt")


def _hf_peft(hf_dir: Path, adapter: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(base, base + our exported adapter) log-probs of TOKENS through transformers and peft, CPU fp32."""
    from peft import PeftModel

    hf = hf_model(hf_dir)
    with torch.no_grad():
        base = hf(TOKENS).logits.log_softmax(-1)
        return base, PeftModel.from_pretrained(hf, str(adapter)).eval()(TOKENS).logits.log_softmax(-1)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_fsdp2_adapter_matches_hf_peft_for_each_family(tmp_path: Path, case: str) -> None:
    name, make = CASES[case]
    hf_dir = make(tmp_path / "hf")
    run_ranks(2, _export_and_score, hf_toml(name, hf_dir), str(tmp_path / "adapter"), True)
    base, theirs = _hf_peft(hf_dir, tmp_path / "adapter")
    ours = torch.load(tmp_path / "titan_log_probs.pt")["fp32"]
    diff, effect = (ours - theirs).abs().max().item(), (theirs - base).abs().max().item()
    print(f"{case}: max |log_softmax titan - hf+peft| = {diff:.2e}; adapter effect {effect:.2f}")
    assert effect > 0.5, f"the adapter moved the log-probs by only {effect:.3f}: this test would prove nothing"
    assert diff <= 1e-4, f"{case}: max |log_softmax titan - hf+peft| = {diff:.2e} (adapter effect {effect:.2f})"


TP_CASES = ["llama3-gqa-tied-sharded", "qwen3-qknorm-headdim32-untied"]


@needs_gpus(2)
@pytest.mark.parametrize("case", TP_CASES)
def test_tp2_adapter_matches_hf_peft_on_two_gpus(tmp_path: Path, case: str) -> None:
    _tp_parity(tmp_path, case, 2, TP2)


@needs_gpus(4)
@pytest.mark.parametrize("case", TP_CASES)
def test_tp2_fsdp2_adapter_matches_hf_peft_on_four_gpus(tmp_path: Path, case: str) -> None:
    _tp_parity(tmp_path, case, 4, TP2_FSDP2)


def _tp_parity(tmp_path: Path, case: str, gpus: int, layout: tuple[str, ...]) -> None:
    name, make = CASES[case]
    hf_dir = make(tmp_path / "hf")
    # torchtitan's Qwen3 TP plan hands DTensors to SDPA; in fp32 with GQA only SDPA's math kernel applies,
    # which DTensor cannot shard ("Attempted to flatten multiple dimensions"): its TP runs in bf16 only.
    fp32 = name != "qwen3"
    run_ranks(gpus, _export_and_score, hf_toml(name, hf_dir), str(tmp_path / "adapter"), fp32, *layout,
              backend="nccl")
    base, theirs = _hf_peft(hf_dir, tmp_path / "adapter")
    ours = torch.load(tmp_path / "titan_log_probs.pt")
    effect = (theirs - base).abs().max().item()
    diffs = {kind: (scores - theirs).abs().max().item() for kind, scores in ours.items()}
    print(f"{case} {layout}: max |log_softmax titan - hf+peft| {diffs}; adapter effect {effect:.2f}")
    assert effect > 5 * BF16_BOUND, f"the adapter moved the log-probs by only {effect:.3f}: this proves nothing"
    assert set(diffs) == ({"fp32", "bf16"} if fp32 else {"bf16"})
    assert diffs.get("fp32", 0.0) <= 1e-4, f"{case} {layout} fp32: {diffs['fp32']:.2e}"
    assert diffs["bf16"] <= BF16_BOUND, f"{case} {layout} bf16 autocast: {diffs['bf16']:.2e}"
