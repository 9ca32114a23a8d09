"""The base's digests over the trainer's shards equal the engine-side digests of the checkpoint's own tensors
(HF layout, RoPE rows undone) on 1 rank and TP=2 x FSDP=2 on 4 gloo ranks (which shards on the FSDP dim
alone too, e.g. the norms, replicated over TP; FSDP on 2 ranks alone took the same path and was dropped to
save a 2-rank run); a changed element, a swapped row, a cast and a renamed tensor change them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks
from model_helpers import TP2_FSDP2, build_from
from safetensors.torch import load_file
from tiny_checkpoints import hf_toml, tiny_llama, tiny_qwen3

from titan_lora.sync.base_digest import base_digests
from titan_lora.transfer.digest import tensor_digest


def _engine_digests(hf_dir: Path, tied: bool) -> dict[str, str]:
    """What an engine that loaded `hf_dir` computes: each tensor of the files, whole, in HF layout."""
    tensors = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    if tied:
        tensors.pop("lm_head.weight", None)
    return {name: tensor_digest(name, t) for name, t in tensors.items()}


def _digest_on_ranks(rank: int, world: int, toml: str, out: str, *overrides: str) -> None:
    built = build_from(toml, *overrides)
    digests = base_digests(built.model, built.sd_adapter, built.peft_layout, built.tied)
    gathered = [None] * world
    dist.all_gather_object(gathered, digests)
    assert all(g == digests for g in gathered), "every rank gets the same digests"
    if rank == 0:
        Path(out).write_text(json.dumps(digests))


@pytest.mark.parametrize(("family", "make", "tied", "layout"), [
    ("llama3", tiny_llama, True, "1 rank"), ("llama3", tiny_llama, True, "tp2 x fsdp2"), ("qwen3", tiny_qwen3, False, "tp2 x fsdp2")])
def test_the_trainers_sharded_digests_equal_the_engines_over_the_checkpoint(tmp_path, family, make, tied,
                                                                              layout) -> None:
    hf_dir = make(tmp_path / "hf", tied=tied)
    world, overrides = {"1 rank": (1, ()), "tp2 x fsdp2": (4, TP2_FSDP2)}[layout]
    out = tmp_path / "digests.json"
    run_ranks(world, _digest_on_ranks, hf_toml(family, hf_dir), str(out), *overrides)
    trainer = json.loads(out.read_text())
    engine = _engine_digests(hf_dir, tied)
    assert sorted(trainer) == sorted(engine), "the same tensors, by HF name"
    wrong = [n for n in engine if trainer[n] != engine[n]]
    assert not wrong, f"digests differ for {wrong}"


def test_a_changed_element_a_swapped_row_a_cast_and_another_name_change_the_digest() -> None:
    torch.manual_seed(0)
    w = torch.randn(64, 48)
    base = tensor_digest("model.layers.0.self_attn.q_proj.weight", w)
    bumped = w.clone()
    bumped[17, 5] = torch.nextafter(bumped[17, 5], torch.tensor(float("inf")))  # one ulp
    swapped = w[[1, 0, *range(2, 64)]]
    assert tensor_digest("model.layers.0.self_attn.q_proj.weight", bumped) != base
    assert tensor_digest("model.layers.0.self_attn.q_proj.weight", swapped) != base
    assert tensor_digest("model.layers.0.self_attn.q_proj.weight", w.to(torch.bfloat16)) != base
    assert tensor_digest("model.layers.0.self_attn.k_proj.weight", w) != base
    assert tensor_digest("model.layers.0.self_attn.q_proj.weight", w.clone()) == base
    with pytest.raises(ValueError, match="cannot digest a torch.int64 tensor"):
        tensor_digest("x", torch.zeros(2, dtype=torch.int64))
