"""TP=2 x FSDP=2 on 4 gloo CPU ranks, adapters replicated over the FSDP ranks (the default) or sharded
with the base: adapter placements follow the base's TP plan, the sharded model computes what the 1-rank
model computes, and the gather sends one copy of each element."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks
from model_helpers import (
    DEBUG_LORA,
    TP2_FSDP2,
    build_from,
    check_tp2_placements,
    full_copy,
    randomize_adapters,
)

from titan_lora.lora.layer import adapter_params
from titan_lora.sync.gather import ShardGatherer
from titan_lora.titan.lora_linear import fill_param

TOKENS = torch.randint(0, 49152, (2, 16), generator=torch.Generator().manual_seed(0))


def _tp_ranks(rank: int, world: int, ref_path: str, out_path: str, *adapters: str) -> None:
    built = build_from(DEBUG_LORA, *TP2_FSDP2, *adapters)
    model = built.model
    check_tp2_placements(model)
    ref = torch.load(ref_path)
    named = adapter_params(model)
    init = {n: full_copy(p) for n, p in named}
    # Same weights as the 1-rank reference, then the same randomized adapters.
    for name, param in model.named_parameters():
        fill_param(param, ref["state"][name])
    randomize_adapters(model)
    with torch.no_grad():
        logits = model(TOKENS)
    logits = full_copy(logits)  # vocab-sharded under loss parallel: collective over tp
    gatherer = ShardGatherer(named)
    gathered = gatherer.gather()
    sent = torch.tensor([gatherer.local_numel])
    dist.all_reduce(sent)
    # Each element is sent once: TP's replicated halves (colwise lora_A, rowwise lora_B) only from tp rank 0.
    assert int(sent) == sum(p.numel() for _, p in named), f"{int(sent)} elements sent for one copy of each"
    full = {n: full_copy(p) for n, p in named}
    if rank == 0:
        torch.save({"init": init, "logits": logits, "gathered": {k: v.clone() for k, v in gathered.items()},
                    "full": full}, out_path)
    else:
        assert gathered is None
    dist.barrier()


@pytest.mark.parametrize("adapters", [(), ("--lora.no_replicate_adapters",)],
                         ids=["replicated", "fsdp-sharded"])
def test_tp2_fsdp2_placements_and_parity(tmp_path, adapters: tuple[str, ...]) -> None:
    torch.manual_seed(0)
    reference = build_from(DEBUG_LORA).model  # 1 rank, no sharding
    init = {n: p.detach().clone() for n, p in adapter_params(reference)}
    state = {n: p.detach().clone() for n, p in reference.named_parameters()}
    randomize_adapters(reference)
    with torch.no_grad():
        ref_logits = reference(TOKENS)
    ref_adapters = {n: p.detach().clone() for n, p in adapter_params(reference)}
    torch.save({"state": state}, tmp_path / "ref.pt")

    run_ranks(4, _tp_ranks, str(tmp_path / "ref.pt"), str(tmp_path / "tp.pt"), *adapters)
    tp = torch.load(tmp_path / "tp.pt")

    for name, value in init.items():  # kaiming A / zero B do not depend on the sharding
        assert torch.equal(tp["init"][name], value), f"{name} initialised differently under TP x FSDP"
    assert list(tp["gathered"]) == list(ref_adapters)
    for name, value in ref_adapters.items():
        assert torch.equal(tp["full"][name], value), f"{name}: full_tensor() differs from the 1-rank adapter"
        assert torch.equal(tp["gathered"][name], tp["full"][name]), f"{name}: ShardGatherer != full_tensor()"
    diff = (tp["logits"] - ref_logits).abs().max().item()
    effect = (ref_logits - _base_logits(reference)).abs().max().item()
    print(f"TP2xFSDP2 vs 1 rank: max |logit diff| = {diff:.2e} (adapter effect {effect:.2f})")
    assert effect > 1e-2, "the adapter must change the logits, or parity proves nothing about it"
    assert diff <= 1e-4


@torch.no_grad()
def _base_logits(model: torch.nn.Module) -> torch.Tensor:
    saved = {n: p.detach().clone() for n, p in adapter_params(model)}
    for _, p in adapter_params(model):
        if _.endswith("lora_B"):
            p.zero_()
    out = model(TOKENS)
    for n, p in adapter_params(model):
        p.copy_(saved[n])
    return out
