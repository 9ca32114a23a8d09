"""One SFT step on 1 rank and on 2 FSDP ranks, on 2 TP ranks and on TP=2 x FSDP=2, with the adapters
replicated (the default) or sharded by FSDP: same loss, same gradients, same updated adapter; the base
gets no gradient and does not move; the optimizer holds only the adapter. On CPU (gloo) and, with
`pytest -m gpu`, on 2 GPUs (NCCL): the same fp32 bounds hold (TF32 is off, torch's default)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_helpers import needs_gpus, run_ranks
from model_helpers import (DEBUG_LORA, ONE_STEP_SECTIONS, TP2, TP2_FSDP2, full_copy, job_config_from,
                           randomize_adapters)

from torch.distributed.tensor import DTensor

from titan_lora.lora.layer import adapter_params, is_adapter_param
from titan_lora.titan.lora_linear import fill_param

REPO = Path(__file__).resolve().parents[2]
TRAIN = DEBUG_LORA + ONE_STEP_SECTIONS


@torch.no_grad()
def _seeded_base(model: torch.nn.Module) -> None:
    """The same base weights for any sharding (torchtitan's random init depends on the sharding)."""
    for i, (name, param) in enumerate(model.named_parameters()):
        if not is_adapter_param(name):
            g = torch.Generator().manual_seed(1000 + i)
            full = torch.ones(param.shape) if "norm" in name else torch.randn(param.shape, generator=g) * 0.05
            fill_param(param, full)


def _one_step(rank: int, world: int, dump: str, out: str, *layout: str) -> None:
    from titan_lora.train import TrainingRun

    data_parallel = world // (2 if "--parallelism.tensor_parallel_degree=2" in layout else 1)
    cfg = job_config_from(
        TRAIN, f"--job.dump_folder={dump}", "--training.global_batch_size=8",
        f"--training.local_batch_size={8 // data_parallel}", "--training.steps=1",
        f"--data.path={REPO / 'titan_lora/data/arith_sft.jsonl'}", *layout,
    )
    run = TrainingRun(cfg)
    try:
        model = run.model
        _seeded_base(model)
        randomize_adapters(model, seed=5)  # B != 0, so lora_A gets a gradient as well
        named = adapter_params(model)
        if world > 1:  # replicated (the default): outside FSDP, plain or on the TP mesh alone; else FSDP's
            meshes = {p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else None for _, p in named}
            tp = "--parallelism.tensor_parallel_degree=2" in layout
            sharded = {("fsdp", "tp") if tp else ("fsdp",)}
            want = sharded if SHARDED[0] in layout else {("tp",) if tp else None}
            assert meshes == want, (meshes, layout)
        before = {n: full_copy(p) for n, p in named}
        base_before = {n: full_copy(p) for n, p in model.named_parameters() if not is_adapter_param(n)}

        in_optimizer = {id(p) for opt in run.optimizers.optimizers for g in opt.param_groups for p in g["params"]}
        assert in_optimizer == {id(p) for _, p in named}, "the optimizer must hold exactly the adapter params"

        run.step = 1
        metrics = run.train_step()

        grads = {n: full_copy(p.grad) for n, p in named}
        after = {n: full_copy(p) for n, p in named}
        for n, p in model.named_parameters():
            if not is_adapter_param(n):
                assert not p.requires_grad and p.grad is None, f"a gradient reached the base weight {n}"
        base_after = {n: full_copy(p) for n, p in model.named_parameters() if not is_adapter_param(n)}
        if rank == 0:
            torch.save({"loss": metrics["loss"], "tokens": metrics["tokens"], "grad_norm": metrics["grad_norm"],
                        "before": before, "after": after, "grads": grads,
                        "base_unchanged": all(torch.equal(base_before[n], base_after[n]) for n in base_before)},
                       out)
    finally:
        run.close()


def test_one_step_on_one_and_two_ranks_is_the_same(tmp_path, one_rank) -> None:
    _one_vs_two_ranks(tmp_path, one_rank, "gloo")


def test_one_step_on_one_rank_and_under_tp2_is_the_same(tmp_path, one_rank) -> None:
    _one_vs_two_ranks(tmp_path, one_rank, "gloo", *TP2)


@pytest.mark.slow
def test_one_step_on_one_rank_and_under_tp2_fsdp2_is_the_same(tmp_path, one_rank) -> None:
    _one_vs_two_ranks(tmp_path, one_rank, "gloo", *TP2_FSDP2, ranks=4)


SHARDED = ("--lora.no_replicate_adapters",)
REPLICAS2 = ("--parallelism.data_parallel_replicate_degree=2", "--parallelism.data_parallel_shard_degree=1")
"""Two data-parallel replicas, no FSDP: the whole base on each rank, the adapters summed over both."""
HSDP = ("--parallelism.data_parallel_replicate_degree=2", "--parallelism.data_parallel_shard_degree=2")


def test_one_step_on_one_rank_and_on_two_replicas_without_fsdp_is_the_same(tmp_path, one_rank) -> None:
    _one_vs_two_ranks(tmp_path, one_rank, "gloo", *REPLICAS2)


def _build_unsummed(rank: int, world: int) -> None:
    from model_helpers import build_from

    with pytest.raises(ValueError, match="neither sharded nor summed"):
        build_from(DEBUG_LORA, *REPLICAS2, *SHARDED)


def test_replicas_without_fsdp_and_without_replicated_adapters_are_refused_at_the_build() -> None:
    """Nothing would reduce the adapters' gradients: each replica would train its own adapter."""
    run_ranks(2, _build_unsummed)


@pytest.mark.slow
def test_one_step_on_one_rank_and_under_hsdp_2x2_is_the_same(tmp_path, one_rank) -> None:
    _one_vs_two_ranks(tmp_path, one_rank, "gloo", *HSDP, ranks=4)


def test_one_step_with_fsdp_sharded_adapters_on_one_and_two_ranks_is_the_same(tmp_path, one_rank) -> None:
    """`[lora] replicate_adapters = false`: adapters sharded by FSDP with the base, reduce-scattered by it."""
    _one_vs_two_ranks(tmp_path, one_rank, "gloo", *SHARDED)


@pytest.mark.slow
def test_one_step_with_fsdp_sharded_adapters_under_tp2_fsdp2_is_the_same(tmp_path, one_rank) -> None:
    _one_vs_two_ranks(tmp_path, one_rank, "gloo", *TP2_FSDP2, *SHARDED, ranks=4)


@needs_gpus(2)
def test_one_step_on_one_and_two_gpus_is_the_same(tmp_path, one_rank) -> None:
    _one_vs_two_ranks(tmp_path, one_rank, "nccl")


@needs_gpus(2)
def test_one_step_with_fsdp_sharded_adapters_on_one_and_two_gpus_is_the_same(tmp_path, one_rank) -> None:
    _one_vs_two_ranks(tmp_path, one_rank, "nccl", *SHARDED)


@needs_gpus(2)
def test_one_step_on_one_gpu_and_under_tp2_is_the_same(tmp_path, one_rank) -> None:
    _one_vs_two_ranks(tmp_path, one_rank, "nccl", *TP2)


@needs_gpus(4)
def test_one_step_on_one_gpu_and_under_tp2_fsdp2_is_the_same(tmp_path, one_rank) -> None:
    _one_vs_two_ranks(tmp_path, one_rank, "nccl", *TP2_FSDP2, ranks=4)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """backend -> the 1-rank step every layout is compared with: it takes no layout, so it runs once per
    backend for the module (a read-only dict of tensors)."""
    done: dict[str, dict] = {}

    def step(backend: str) -> dict:
        if backend not in done:
            tmp = tmp_path_factory.mktemp(f"one_rank_{backend}")
            run_ranks(1, _one_step, str(tmp / "d1"), str(tmp / "one.pt"), backend=backend)
            done[backend] = torch.load(tmp / "one.pt")
        return done[backend]

    return step


def _one_vs_two_ranks(tmp_path, one_rank, backend: str, *layout: str, ranks: int = 2) -> None:
    one = one_rank(backend)
    run_ranks(ranks, _one_step, str(tmp_path / "d2"), str(tmp_path / "two.pt"), *layout, backend=backend)
    two = torch.load(tmp_path / "two.pt")

    assert one["base_unchanged"] and two["base_unchanged"], "a base weight changed during the step"
    assert one["tokens"] == two["tokens"] > 0, "both runs must see the same global batch"
    print(f"{backend} {layout or 'FSDP'}: loss 1 rank {one['loss']:.8f}, {ranks} ranks {two['loss']:.8f}; "
          f"grad norm {one['grad_norm']:.6f} vs {two['grad_norm']:.6f}")
    assert abs(one["loss"] - two["loss"]) <= 1e-5
    assert abs(one["grad_norm"] - two["grad_norm"]) <= 1e-5 * max(1.0, one["grad_norm"])
    assert list(one["after"]) == list(two["after"])
    worst_grad = worst_param = 0.0
    for name in one["after"]:
        assert torch.equal(one["before"][name], two["before"][name]), f"{name} started differently"
        g1, g2 = one["grads"][name], two["grads"][name]
        assert g1.abs().sum() > 0, f"{name} got no gradient"
        worst_grad = max(worst_grad, (g1 - g2).abs().max().item() / g1.abs().max().item())
        worst_param = max(worst_param, (one["after"][name] - two["after"][name]).abs().max().item())
        moved = (one["after"][name] - one["before"][name]).abs().max().item()
        assert moved > 1e-4, f"{name} did not move: the comparison would prove nothing"
    print(f"max relative grad diff {worst_grad:.2e}; max |updated adapter diff| {worst_param:.2e}")
    assert worst_grad <= 1e-4, "gradients differ between 1 and 2 ranks"
    assert worst_param <= 1e-5, "updated adapters differ between 1 and 2 ranks"
