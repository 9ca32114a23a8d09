"""The service's mixed step on 2 FSDP ranks (gloo) splits its rows over them and gives what 1 rank gives (and
on 2 TP ranks, which run every row):
every datum's log-probs, every request's loss and every slot's weights after its optim_steps, with a rank
left only padding, forward-only requests beside training ones, and a bad request failing alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from dist_helpers import needs_gpus, rank_device, run_ranks
from tiny_checkpoints import hf_toml, tiny_llama

from titan_lora.service.main import build_slots, service_job
from titan_lora.service.slots import AdamStep, SlotSpec
from titan_lora.service.step import Limits, Work, run_step
from titan_lora.service.wire import Datum, ForwardBackward
from titan_lora.trainer.job_config import job_from_toml

ADAM = AdamStep(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, grad_clip_norm=1.0)
VOCAB = 256


def _request(seed: int, rows: int, length: int = 12, forward_only: bool = False) -> ForwardBackward:
    rng = np.random.default_rng(seed)
    data = []
    for r in range(rows):
        n = length + r  # rows of several lengths: the padding differs per rank
        tokens = rng.integers(3, VOCAB, n + 1)
        weights = rng.uniform(0.5, 1.5, n).astype(np.float32)
        data.append(Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": weights}))
    return ForwardBackward("m", 1, "cross_entropy", {}, forward_only, data)


ROUNDS = [
    [(0, _request(1, 3)), (1, _request(2, 2))],  # 5 rows over 2 ranks: 3 and 2 (+1 padding)
    [(1, _request(3, 1))],  # one row: rank 1 runs padding only
    [(0, _request(4, 2)), (1, _request(5, 3, forward_only=True))],  # rank 1's rows are forward-only
    [(0, _request(6, 1)), (1, _request(7, 2))],
]


def _serve_rounds(rank: int, world: int, hf_dir: str, out: str, tp: int = 1) -> None:
    cfg, resolved = job_from_toml(hf_toml("llama3", hf_dir) + "[service]\nmax_adapters = 3\nmax_rank = 8\n"
                                  f"[parallelism]\ntensor_parallel_degree = {tp}\n")
    device = rank_device()
    built, slots, data_parallel = build_slots(service_job(cfg, world), resolved, device)
    assert data_parallel.size == world // tp  # TP ranks run the same rows
    limits = Limits(VOCAB, 64, 4096, micro_batch_tokens=24)  # a row or two a forward: ranks run unequal counts
    slots.claim(0, SlotSpec(rank=4, seed=1))
    slots.claim(1, SlotSpec(rank=8, seed=2))
    bad = _request(9, 2)
    bad.data[1].tokens[0] = VOCAB + 1
    seen = []
    for works in ROUNDS:
        outcomes = run_step(built.model, [Work(s, r) for s, r in works] + [Work(0, bad)], slots.count, limits,
                            device, data_parallel.group)
        assert f"token id {VOCAB + 1} outside the vocabulary" in outcomes[-1].error
        seen.append([(o.metrics["loss:sum"], o.logprobs) for o in outcomes[:-1]])
        for slot in sorted({s for s, r in works if not r.forward_only}):
            slots.step(slot, ADAM)
    weights = {slot: slots.state(slot, with_optimizer=False)["params"] for slot in (0, 1)}  # collective
    if rank == 0:
        torch.save({"seen": seen, "weights": weights}, out)


@pytest.fixture(scope="module")
def one_cpu_rank(tmp_path_factory) -> tuple[str, dict]:
    """The tiny checkpoint, and what 1 CPU rank gives for the rounds."""
    root = tmp_path_factory.mktemp("rounds")
    hf_dir = str(tiny_llama(root / "tiny", vocab=VOCAB))
    run_ranks(1, _serve_rounds, hf_dir, str(root / "one.pt"))
    return hf_dir, torch.load(root / "one.pt", weights_only=False)


def _as_one_cpu_rank(one_cpu_rank: tuple[str, dict], out: Path, world: int, atol: float, tp: int = 1,
                     backend: str = "gloo") -> None:
    hf_dir, expected = one_cpu_rank
    run_ranks(world, _serve_rounds, hf_dir, str(out), tp, backend=backend)
    _same(expected, torch.load(out, weights_only=False), atol)


def test_two_ranks_split_the_rows_and_give_what_one_rank_gives(one_cpu_rank, tmp_path) -> None:
    _as_one_cpu_rank(one_cpu_rank, tmp_path / "fsdp.pt", 2, 1e-5)


def test_two_tensor_parallel_ranks_give_what_one_rank_gives(one_cpu_rank, tmp_path) -> None:
    _as_one_cpu_rank(one_cpu_rank, tmp_path / "tp.pt", 2, 1e-5, tp=2)


@needs_gpus(2)
def test_two_nccl_ranks_give_what_one_cpu_rank_gives(one_cpu_rank, tmp_path) -> None:
    _as_one_cpu_rank(one_cpu_rank, tmp_path / "nccl.pt", 2, 1e-4, backend="nccl")


@needs_gpus(1)
def test_one_gpu_gives_what_one_cpu_rank_gives(one_cpu_rank, tmp_path) -> None:
    _as_one_cpu_rank(one_cpu_rank, tmp_path / "gpu.pt", 1, 1e-4, backend="nccl")


def _same(one: dict, two: dict, atol: float) -> None:
    """Every loss (relative), log-prob and adapter weight of two runs of the rounds within `atol`."""
    for round_one, round_two in zip(one["seen"], two["seen"], strict=True):
        for (loss_one, lp_one), (loss_two, lp_two) in zip(round_one, round_two, strict=True):
            assert abs(loss_one - loss_two) <= atol * abs(loss_one), (loss_one, loss_two)
            for a, b in zip(lp_one, lp_two, strict=True):
                np.testing.assert_allclose(b, a, rtol=0, atol=atol)
    moved = 0.0
    for slot in (0, 1):
        for name, value in one["weights"][slot].items():
            torch.testing.assert_close(two["weights"][slot][name].cpu(), value.cpu(), rtol=0, atol=atol)
            moved = max(moved, float(value.abs().max()))
    assert moved > 1e-3  # the slots trained: the comparison is not of untouched zeros
