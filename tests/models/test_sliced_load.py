"""Each rank reads only its shards' slices of the checkpoint, and gets what the full read gave, bit for bit.

2 gloo ranks, FSDP and TP=2 (and 4 ranks, FSDP x TP), Llama (RoPE rows permuted per head) and Qwen3
(head_dim != dim / heads).
The shapes split unevenly: a vocabulary of 257 rows, and one KV head of 16 rows, so the 2 FSDP ranks cut it
inside the head and the RoPE permutation must be applied to a slice (under TP, two KV heads: torchtitan 0.3.0
needs the TP degree to divide them; FSDP over TP then cuts each rank's head).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_helpers import run_ranks
from model_helpers import TP2, TP2_FSDP2, build_from
from tiny_checkpoints import hf_toml, tiny_llama, tiny_qwen3
from torch.distributed.tensor import DTensor

import titan_lora.models.checkpoint as checkpoint
from titan_lora.lora.layer import clean_fqn, is_adapter_param
from titan_lora.models.checkpoint import read_hf_state_dict, weight_shapes
from titan_lora.models.load import load_base_weights, load_base_weights_full

VOCAB = 257  # odd: FSDP and TP split the embedding and the output head unevenly


def _checkpoints(root: Path, kv_heads: int = 1) -> list[tuple[str, Path]]:
    return [("llama3", tiny_llama(root / "llama", vocab=VOCAB, tied=True, kv_heads=kv_heads)),
            ("qwen3", tiny_qwen3(root / "qwen3", vocab=VOCAB, tied=False, kv_heads=kv_heads))]


def _base_locals(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {clean_fqn(n): (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters() if not is_adapter_param(n)}


def _no_full_reads(*_: object, **__: object) -> None:
    raise AssertionError("the sliced load read a whole safetensors file")


def _sliced_equals_full(rank: int, world: int, checkpoints: list[tuple[str, Path]],
                        overrides: tuple[str, ...]) -> None:
    for name, hf_dir in checkpoints:
        built = build_from(hf_toml(name, hf_dir), *overrides)  # the trainer's path: the sliced load
        sliced = _base_locals(built.model)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(checkpoint, "load_file", _no_full_reads)
            reader = load_base_weights(built.model, hf_dir, built.sd_adapter, built.tied)
        with torch.no_grad():
            for p in built.model.parameters():
                p.zero_()
        load_base_weights_full(built.model, hf_dir, built.sd_adapter, built.tied)
        full = _base_locals(built.model)
        differ = [n for n in full if not torch.equal(sliced[n], full[n])]
        assert not differ, f"rank {rank}, {name}: the sliced load differs from the full read in {differ}"
        total = sum(t.numel() * t.element_size() for t in weight_shapes(hf_dir).values())
        # FSDP: each rank its half (plus the rest of a KV head cut in two); TP: norms are replicated.
        assert reader.bytes_read <= 0.6 * total, (name, reader.bytes_read, total)


@pytest.mark.parametrize("overrides", [(), TP2], ids=["fsdp2", "tp2"])
def test_the_sliced_load_gives_the_full_reads_parameters_bit_for_bit(tmp_path: Path,
                                                                   overrides: tuple[str, ...]) -> None:
    run_ranks(2, _sliced_equals_full, _checkpoints(tmp_path, kv_heads=2 if overrides else 1), overrides)


def _sliced_equals_from_hf(rank: int, world: int, checkpoints: list[tuple[str, Path]]) -> None:
    for name, hf_dir in checkpoints:
        built = build_from(hf_toml(name, hf_dir), *TP2_FSDP2)
        expected = built.sd_adapter.from_hf(read_hf_state_dict(hf_dir, built.tied))
        for fqn, p in built.model.named_parameters():
            if not is_adapter_param(fqn):
                got, want = p.full_tensor(), expected[clean_fqn(fqn)]
                assert torch.equal(got, want), f"{name}: {fqn} ({p.placements})"


def test_the_sliced_load_reads_fsdps_strided_shards_over_tp(tmp_path: Path) -> None:
    # FSDP x TP shards dim 0 twice (a strided shard), unevenly here: the former full read cannot load
    # that (DTensor's scatter asserts even chunks), so the reference is the adapter's own full mapping.
    run_ranks(4, _sliced_equals_from_hf, _checkpoints(tmp_path, kv_heads=2))
