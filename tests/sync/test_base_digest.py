"""The base's digests over the trainer's shards equal the engine-side digests of the checkpoint's own tensors
(HF layout, RoPE rows undone) on 1 rank and TP=2 x FSDP=2 on 4 gloo ranks (which shards on the FSDP dim
alone too, e.g. the norms, replicated over TP; FSDP on 2 ranks alone took the same path and was dropped to
save a 2-rank run); a changed element, a swapped row or column, a cast and a renamed tensor change them; no weight is 0 and no two
columns share both lanes' weights."""

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
from titan_lora.transfer.digest import (
    _ROW,
    COLUMN_WEIGHT_BOUND,
    PRIMES,
    _salt,
    block_digest,
    column_weights,
    tensor_digest,
)


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


DOWN_PROJ_WIDTH = 28672  # Llama-3-70B's intermediate size: the columns of each layer's down_proj


def test_two_swapped_columns_of_a_wide_matrix_change_the_digest() -> None:
    name = "model.layers.2.mlp.down_proj.weight"  # columns 8247 and 12107 once shared both lanes' weights
    row = torch.randn(2, DOWN_PROJ_WIDTH, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    swapped = row.clone()
    swapped[:, [8247, 12107]] = row[:, [12107, 8247]]
    assert tensor_digest(name, swapped) != tensor_digest(name, row)


@pytest.mark.parametrize("layer", [0, 2, 39, 64, 79])
def test_no_two_columns_share_both_weights_and_none_is_zero(layer: int) -> None:
    weights = column_weights(f"model.layers.{layer}.mlp.down_proj.weight", torch.arange(DOWN_PROJ_WIDTH))
    pairs = weights[0] * (COLUMN_WEIGHT_BOUND + 1) + weights[1]
    assert pairs.unique().numel() == DOWN_PROJ_WIDTH, "two columns share both lanes' weights"
    assert weights.min() >= 1 and weights.max() <= COLUMN_WEIGHT_BOUND
    # Over 2^22 columns each lane's map hits its edge (a half of 0 before the + 1) about 128 times.
    wide = column_weights("model.embed_tokens.weight", torch.arange(2**22))
    assert wide.min() >= 1 and wide.max() <= COLUMN_WEIGHT_BOUND
    assert (wide[0] * (COLUMN_WEIGHT_BOUND + 1) + wide[1]).unique().numel() == 2**22


@pytest.mark.parametrize("lane", [0, 1])
def test_the_row_whose_weight_map_meets_zero_still_counts(lane: int) -> None:
    name, prime = "model.layers.0.mlp.down_proj.weight", PRIMES[lane]
    mult, offset = _ROW
    # The row r with r * mult + offset + salt = 0 (mod p): the one a weight map without its + 1 would drop.
    row = (-(offset + _salt(name, lane)) * pow(mult, -1, prime)) % prime
    values = torch.randn(1, 4, generator=torch.Generator().manual_seed(1))
    bumped = values.clone()
    bumped[0, 2] = torch.nextafter(bumped[0, 2], torch.tensor(float("inf")))  # one ulp
    rows, cols = torch.tensor([row]), torch.arange(4)
    before, after = block_digest(name, values, rows, cols), block_digest(name, bumped, rows, cols)
    assert after[lane] != before[lane], f"a change in row {row} is invisible to lane {lane}"
