"""Qwen3 under TP=2 (2 gloo ranks): the adapters' placements follow torchtitan's own Qwen3 plan.

Only the placements are checked on CPU: torchtitan's Qwen3 plan keeps q/k/v as DTensors through
attention (its q/k norms are sequence-parallel over heads), and DTensor has no sharding rule for the
CPU sdpa kernel (`_scaled_dot_product_flash_attention_for_cpu`), so a TP forward needs GPUs: it runs
in tests/export/test_family_parity.py under `pytest -m gpu`.
"""

from __future__ import annotations

from dist_helpers import run_ranks
from model_helpers import DEBUG_LORA, TP2, build_from, check_tp2_placements
from torch.distributed.tensor import DTensor, Replicate


def _placements(rank: int, world: int, toml: str) -> None:
    built = build_from(toml, *TP2)
    check_tp2_placements(built.model)
    q_norm = built.model.layers["0"].attention.q_norm.weight
    assert isinstance(q_norm, DTensor) and q_norm.placements == (Replicate(),), "Qwen3's plan: q/k norms replicated"


def test_qwen3_tp2_adapter_placements_follow_its_plan(smollm2_dir) -> None:
    toml = DEBUG_LORA.replace('name = "smollm2"', f'name = "qwen3"\nhf_assets_path = "{smollm2_dir}"')
    run_ranks(2, _placements, toml)
