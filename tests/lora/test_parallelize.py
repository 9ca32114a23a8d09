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
    embedding, output = model.tok_embeddings, model.lm_head
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


BF16_PARAMS = "--training.mixed_precision_param=bfloat16"


def _step_in_bf16(rank: int, world: int, toml: str) -> None:
    import titan_lora.lora.parallelize as parallelize

    results = {}
    for stored in ("bf16", "fp32"):
        if stored == "fp32":  # what FSDP did before: fp32 frozen shards, cast at every all-gather
            parallelize.store_frozen_as = lambda model, dtype: None
        model = build_from(toml, BF16_PARAMS).model
        randomize_adapters(model)
        frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
        trained = {p.dtype for p in model.parameters() if p.requires_grad}
        assert frozen == {torch.bfloat16 if stored == "bf16" else torch.float32}, frozen
        assert trained == {torch.float32}, "the adapters keep [lora] dtype"
        assert model.lm_head.weight is model.tok_embeddings.weight, "the cast untied the head"
        logits = model(TOKENS[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), TOKENS[:, 1:].flatten())
        loss.backward()
        grads = [full_copy(p.grad) for p in model.parameters() if p.requires_grad]
        results[stored] = (loss.detach(), grads)
    (loss16, grads16), (loss32, grads32) = results["bf16"], results["fp32"]
    assert torch.equal(loss16, loss32), f"loss {loss16.item()} (bf16 frozen shards) vs {loss32.item()} (fp32)"
    assert all(torch.equal(a, b) for a, b in zip(grads16, grads32, strict=True)), "adapter gradients differ"


@pytest.mark.slow
def test_frozen_base_is_stored_in_the_compute_dtype_with_bit_identical_loss_and_grads(tmp_path: Path) -> None:
    """With bf16 params under FSDP, the frozen base (tied head included) is kept in bf16, not fp32: the
    all-gather would cast it anyway, so loss and adapter gradients are bit-identical and its memory halves."""
    run_ranks(2, _step_in_bf16, hf_toml("qwen3", tiny_qwen3(tmp_path / "hf", tied=True)))
