"""Qwen3 under TP=2 (2 gloo ranks): the adapters' placements follow torchtitan's own Qwen3 plan.

Only the placements are checked on CPU: torchtitan's Qwen3 plan keeps q/k/v as DTensors through
attention (its q/k norms are sequence-parallel over heads), and DTensor has no sharding rule for the
CPU sdpa kernel (`_scaled_dot_product_flash_attention_for_cpu`), so a TP forward needs GPUs.
"""

from __future__ import annotations

from dist_helpers import run_ranks
from model_helpers import DEBUG_LORA, build_from
from torch.distributed.tensor import DTensor, Replicate, Shard

from titan_lora.lora.layer import lora_modules

COLWISE = {"wq", "wk", "wv", "w1", "w3"}
ROWWISE = {"wo", "w2"}


def _placements(rank: int, world: int, toml: str) -> None:
    built = build_from(toml, "--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1")
    seen = set()
    for name, module in lora_modules(built.model):
        leaf = name.rsplit(".", 1)[-1]
        seen.add(leaf)
        w, a, b = module.weight, module.lora_A, module.lora_B
        assert all(isinstance(t, DTensor) for t in (w, a, b)), name
        want = (Shard(0), Replicate(), Shard(0)) if leaf in COLWISE else (Shard(1), Shard(1), Replicate())
        assert (w.placements[0], a.placements[0], b.placements[0]) == want, (name, w.placements, a.placements,
                                                                            b.placements)
        assert a.to_local().numel() * (2 if leaf in ROWWISE else 1) == a.numel(), name
        assert b.to_local().numel() * (2 if leaf in COLWISE else 1) == b.numel(), name
    assert seen == COLWISE | ROWWISE
    q_norm = built.model.layers["0"].attention.q_norm.weight
    assert isinstance(q_norm, DTensor) and q_norm.placements == (Replicate(),), "Qwen3's plan: q/k norms replicated"


def test_qwen3_tp2_adapter_placements_follow_its_plan(smollm2_dir) -> None:
    toml = DEBUG_LORA.replace('name = "smollm2"', f'name = "qwen3"\nhf_assets_path = "{smollm2_dir}"')
    run_ranks(2, _placements, toml)
