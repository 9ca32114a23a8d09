"""Qwen3 under TP (gloo ranks): the adapters' placements follow the base's shardings (TP=2), and a tied head
stays one parameter in one FSDP group (TP=2 x FSDP=2). A Qwen3 TP forward runs in
tests/export/test_family_parity.py under `pytest -m gpu`.
"""

from __future__ import annotations

from dist_helpers import run_ranks
from model_helpers import DEBUG_LORA, TP2, TP2_FSDP2, build_from, check_tp2_placements
from torch.distributed.tensor import DTensor, Replicate


def _placements(rank: int, world: int, toml: str) -> None:
    built = build_from(toml, *TP2)
    check_tp2_placements(built.model)
    q_norm = built.model.layers["0"].attention.q_norm.weight
    assert isinstance(q_norm, DTensor) and q_norm.placements == (Replicate(),), "Qwen3's plan: q/k norms replicated"


def test_qwen3_tp2_adapter_placements_follow_its_plan(smollm2_dir) -> None:
    toml = DEBUG_LORA.replace('name = "smollm2"', f'name = "qwen3"\nhf_assets_path = "{smollm2_dir}"')
    run_ranks(2, _placements, toml)


def _tied_head_groups(rank: int, world: int, toml: str) -> None:
    from torch.distributed.fsdp import FSDPModule

    model = build_from(toml, *TP2_FSDP2).model
    head, embedding = model.lm_head, model.tok_embeddings
    assert head.weight is embedding.weight, "the tied head came untied"
    assert isinstance(head, FSDPModule) and head._get_fsdp_state() is embedding._get_fsdp_state(), (
        "TP gave the tied pair two parameters, and FSDP sharded them in two groups")


def test_qwen3_tied_head_stays_one_fsdp_group_under_tp2_x_fsdp2(smollm2_dir) -> None:
    """The debug flavor ties its head (as Qwen3 0.6B-4B do): TP places each module's params anew, and FSDP
    needs the tied pair as one parameter in one group."""
    toml = DEBUG_LORA.replace('name = "smollm2"', f'name = "qwen3"\nhf_assets_path = "{smollm2_dir}"')
    run_ranks(4, _tied_head_groups, toml)
