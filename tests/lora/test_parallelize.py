"""FSDP2 over a tied output head (Qwen3 0.6B-4B, `debugmodel`): the tied pair shares one FSDP group, and a
LoRA step on 2 gloo ranks leaves it tied and unchanged (torchtitan's apply_fsdp alone splits the pair and
FSDP refuses the model at its first forward)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dist_helpers import run_ranks
from model_helpers import build_from, full_copy, randomize_adapters
from tiny_checkpoints import hf_toml, tiny_qwen3
from torch.distributed.fsdp import fully_shard

TOKENS = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))


def _step_tied(rank: int, world: int, toml: str) -> None:
    model = build_from(toml).model
    randomize_adapters(model)
    embedding, output = model.tok_embeddings, model.output
    assert output.weight is embedding.weight, "the tiny checkpoint's head is not tied: this test proves nothing"
    assert fully_shard.state(embedding) is fully_shard.state(output), "the tied pair is in two FSDP groups"
    assert fully_shard.state(model.layers["0"]) is not fully_shard.state(output)
    before = full_copy(embedding.weight)
    adapters = [p for p in model.parameters() if p.requires_grad]
    adapter_before = [full_copy(p) for p in adapters]
    optimizer = torch.optim.AdamW(adapters, lr=1e-2)
    logits = model(TOKENS[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), TOKENS[:, 1:].flatten()).backward()
    optimizer.step()
    assert output.weight is embedding.weight, "the step untied the head"
    torch.testing.assert_close(full_copy(output.weight), before, rtol=0, atol=0)
    torch.testing.assert_close(full_copy(embedding.weight), before, rtol=0, atol=0)
    moved = sum(not torch.equal(full_copy(p), b) for p, b in zip(adapters, adapter_before, strict=True))
    assert moved == len(adapters), f"only {moved} of {len(adapters)} adapter params moved in the step"


@pytest.mark.slow
def test_tied_head_shards_into_one_group_and_stays_tied_through_a_step(tmp_path: Path) -> None:
    run_ranks(2, _step_tied, hf_toml("qwen3", tiny_qwen3(tmp_path / "hf", tied=True)))
