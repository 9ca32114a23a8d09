"""ShardGatherer: one collective brings every adapter shard to rank 0, exactly as full_tensor() would
(2 gloo ranks; with `pytest -m gpu` also 2 NCCL ranks on GPUs, where the pack and the scatter, one
index_copy_, replay from CUDA graphs captured once)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_helpers import needs_gpus, run_ranks
from model_helpers import DEBUG_LORA, build_from, full_adapter, randomize_adapters
from torch.distributed.tensor import DTensor

from titan_lora.export.peft import RopeRows, TitanRopeOrder, hf_rope_permute
from titan_lora.lora.layer import adapter_params
from titan_lora.sync.gather import ShardGatherer
from titan_lora.transfer.buckets import bucket_checksum, one_run, plan_buckets

def _finite(gatherer: ShardGatherer) -> bool:
    """`finite_and_checksum`'s flag, once its checksum matched a pass of its own over the one bucket an
    emitter plans of the output (which then goes with no checksum pass)."""
    finite, checksum = gatherer.finite_and_checksum()
    [entries] = plan_buckets(gatherer.views, 1 << 40)
    run = one_run(entries, gatherer.views)
    assert run is not None and run.numel() == gatherer.region_bytes, "the output is not one bucket"
    assert checksum == bucket_checksum(run), "the fused checksum differs from the bucket's own"
    return finite


# rank 3 does not split evenly over 2 FSDP ranks: every lora_A (3 x in) is sharded 2 + 1 rows.
RANK3 = DEBUG_LORA.replace("rank = 8", "rank = 3")


def _gather_on_ranks(rank: int, world: int, scatter: str) -> None:
    model = build_from(RANK3, "--lora.no_replicate_adapters").model  # sharded by FSDP with the base
    randomize_adapters(model, seed=3)
    named = adapter_params(model)
    assert all(isinstance(p, DTensor) for _, p in named)
    local_rows = [p.to_local().shape[0] for n, p in named if n.endswith("lora_A")]
    assert set(local_rows) == {2 if rank == 0 else 1}, "the test needs uneven shards"

    gatherer = ShardGatherer(named, scatter=scatter)
    # On GPU the pack and the index scatter replay from CUDA graphs: the checks below run through them.
    assert gatherer.graphed == (scatter == "index" and named[0][1].device.type == "cuda")
    assert gatherer.nbytes == sum(p.numel() for _, p in named) * 4
    got = gatherer.gather()
    want = full_adapter(named)  # the per-parameter reference (a collective on every rank, same order)
    if rank != 0:
        assert got is None, "only rank 0 receives the gathered adapter"
    else:
        assert list(got) == [n for n, _ in named], "names in the one fixed order"
        for name, tensor in want.items():
            assert got[name].shape == tensor.shape, name
            assert torch.equal(got[name].cpu(), tensor), f"{name} gathered wrong"
        assert _finite(gatherer)

    # An optimizer step updates the shards in place; the next gather must see the new values.
    with torch.no_grad():
        for i, (_, p) in enumerate(named):
            p.to_local().mul_(-2.0).add_(0.01 * i)
    got = gatherer.gather()
    want = full_adapter(named)
    if rank == 0:
        assert all(torch.equal(got[n].cpu(), want[n]) for n in want), "a second gather returned stale values"
        assert _finite(gatherer)

    # A NaN (then an Inf) in a shard that lives only on rank 1 is seen on rank 0.
    name, param = named[2]  # wk.lora_A: its last row lives on rank 1
    for bad in (float("nan"), float("inf")):
        saved = param.to_local().clone()
        with torch.no_grad():
            if rank == 1:
                param.to_local()[-1, -1] = bad
        gatherer.gather()
        if rank == 0:
            assert not _finite(gatherer), f"{bad} on rank 1 went unnoticed"
        with torch.no_grad():
            param.to_local().copy_(saved)
        gatherer.gather()
        if rank == 0:
            assert _finite(gatherer)
    dist.barrier()


@pytest.mark.parametrize("scatter", ["runs", "index"])  # CPU default, GPU default
def test_gather_equals_full_tensor_on_two_ranks_with_uneven_shards(scatter: str) -> None:
    run_ranks(2, _gather_on_ranks, scatter)


def _gather_replicated(rank: int, world: int, scatter: str) -> None:
    model = build_from(RANK3).model  # `[lora] replicate_adapters` is the default
    randomize_adapters(model, seed=3)
    named = adapter_params(model)
    assert not any(isinstance(p, DTensor) for _, p in named), "replicated adapters are plain tensors"
    gatherer = ShardGatherer(named, scatter=scatter)
    assert not gatherer.collective, "rank 0 holds every adapter whole: no collective"
    assert gatherer.local_numel == (sum(p.numel() for _, p in named) if rank == 0 else 0)
    for round_ in range(2):
        got = gatherer.gather()
        if rank != 0:
            assert got is None
            continue
        assert list(got) == [n for n, _ in named]
        for name, param in named:
            assert torch.equal(got[name], param.detach()), f"{name} gathered wrong (round {round_})"
        with torch.no_grad():  # an optimizer step in place: the next gather must see it
            for i, (_, param) in enumerate(named):
                param.mul_(-2.0).add_(0.01 * i)
    dist.barrier()


@pytest.mark.parametrize("scatter", ["runs", "index"])
def test_replicated_adapters_are_copied_on_rank_0_with_no_collective(scatter: str) -> None:
    """`[lora] replicate_adapters` (the default): every rank holds the adapters whole, so rank 0 copies
    its own into the output layout and the other ranks send nothing."""
    run_ranks(2, _gather_replicated, scatter)


@needs_gpus(2)
def test_gather_equals_full_tensor_on_two_gpus_with_uneven_shards() -> None:
    run_ranks(2, _gather_on_ranks, "index", backend="nccl")


def test_single_process_gather_is_the_params_themselves() -> None:
    g = torch.Generator().manual_seed(0)
    named = [("a.lora_A", torch.randn(3, 5, generator=g)), ("a.lora_B", torch.randn(7, 3, generator=g))]
    gatherer = ShardGatherer(named)
    got = gatherer.gather()
    assert list(got) == ["a.lora_A", "a.lora_B"]
    assert all(torch.equal(got[n], p) for n, p in named)
    assert _finite(gatherer)
    named[1][1][0, 0] = float("-inf")
    gatherer.gather()
    assert not _finite(gatherer)


def test_mixed_dtypes_and_empty_lists_are_refused() -> None:
    with pytest.raises(ValueError, match="one dtype"):
        ShardGatherer([("a", torch.zeros(2)), ("b", torch.zeros(2, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match="converter"):
        ShardGatherer([])


def test_a_sum_that_overflows_is_still_finite_element_by_element() -> None:
    big = torch.full((2, 2), 3e38)  # finite float32 values whose sum is inf
    gatherer = ShardGatherer([("a.lora_A", big)])
    gatherer.gather()
    assert _finite(gatherer)
    big[0, 1] = float("nan")
    gatherer.gather()
    assert not _finite(gatherer)


def test_the_index_scatter_moves_8_byte_words_where_every_run_is_whole_words() -> None:
    g = torch.Generator().manual_seed(0)
    rows = lambda t: t.flip(0)  # noqa: E731 (a row permutation, as the RoPE layout of lora_B is)
    whole = [("q.lora_A", torch.randn(4, 12, generator=g).bfloat16()),
             ("q.lora_B", torch.randn(8, 4, generator=g).bfloat16())]
    gatherer = ShardGatherer(whole, layouts=[None, rows], scatter="index")
    got = gatherer.gather()
    assert gatherer.word == 4, "bf16 runs of 4k elements go as int64 words"
    assert torch.equal(got["q.lora_A"], whole[0][1]) and torch.equal(got["q.lora_B"], whole[1][1].flip(0))
    odd = [("k.lora_B", torch.randn(6, 3, generator=g).bfloat16())]  # rows of 3 elements: 6 bytes
    gatherer = ShardGatherer(odd, layouts=[rows], scatter="index")
    assert gatherer.word == 1 and torch.equal(gatherer.gather()["k.lora_B"], odd[0][1].flip(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # numpy copies float32, torch the rest
def test_a_rope_lora_b_goes_as_one_strided_copy_into_hf_order(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    rope = RopeRows(n_heads=3, head_dim=8)
    named = [("q.lora_A", torch.randn(16, 40, generator=g).to(dtype)),
             ("q.lora_B", torch.randn(24, 16, generator=g).to(dtype)),
             ("v.lora_B", torch.randn(24, 16, generator=g).to(dtype))]
    layout = [None, TitanRopeOrder(rope), None]
    runs, index = ShardGatherer(named, layouts=layout, scatter="runs"), ShardGatherer(named, layouts=layout, scatter="index")
    assert runs.scatter_kinds() == {"runs": 2, "strided": 1, "indexed": 0}
    for _ in range(2):  # a step in place between: the copy reads the params each time
        got = runs.gather()
        assert torch.equal(got["q.lora_B"], hf_rope_permute(named[1][1], 3, 8)), "not HF's row order"
        assert all(torch.equal(got[n], index.gather()[n]) for n, _ in named), "differs from the index scatter"
        assert torch.equal(got["q.lora_A"], named[0][1]) and torch.equal(got["v.lora_B"], named[2][1])
        with torch.no_grad():
            for _, p in named:
                p.mul_(-2).add_(1)
