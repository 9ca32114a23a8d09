"""titan_lora's LoRA on torchtitan 0.3.0 over 2 gloo ranks (CPU): FSDP=2 and TP=2 equal one rank's."""

from __future__ import annotations

import json
import socket

import pytest

from tests.titan03.helpers import require_torchtitan_03

require_torchtitan_03()

import torch.multiprocessing as mp  # noqa: E402

from tests.titan03.dist_worker import worker  # noqa: E402

WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(tmp_path, mode: str, spmd_backend: str, sp: bool = False, replicate: bool = False) -> list[list[dict]]:
    mp.spawn(worker, args=(WORLD, free_port(), mode, spmd_backend, sp, str(tmp_path), replicate), nprocs=WORLD,
             join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]


def check(results: list[list[dict]]) -> None:
    for rank, per_family in enumerate(results):
        for r in per_family:
            assert "error" not in r, f"rank {rank}: {r.get('traceback')}"
            print(f"rank {rank} {r['family']}: loss {r['loss']:.6f} vs one rank {r['ref_loss']:.6f} "
                  f"(diff {r['loss_diff']:.2g}), adapter grads max|diff| {r['grad_diff']:.2g} "
                  f"(|grad| max {r['grad_max']:.2g}), init diff {r['init_diff']}, after an SGD step {r['step_diff']:.2g}, "
                  f"logits {r['logits_type']}{r['logits_placements']}, mesh {r['mesh_dims']}")
            assert r["init_diff"] == 0.0 and r["init_nonzero_A"]  # sharded adapter init == one rank's
            assert r["step_diff"] < 1e-5  # after one SGD step (lr 1) on the adapters
            assert r["loss_diff"] < 1e-5
            assert r["grad_diff"] < 1e-5
            assert not r["missing_grads"]
            assert r["n_adapters"] == 2 * 7 * 2
            assert all(n.endswith(("lora_A", "lora_B")) for n in r["trainable"]) and len(r["trainable"]) == 28


BACKENDS = ["partial_dtensor", "full_dtensor"]


@pytest.mark.parametrize("spmd_backend", BACKENDS)
def test_fsdp2(tmp_path, spmd_backend: str) -> None:
    results = run_ranks(tmp_path, "fsdp", spmd_backend)
    check(results)
    for r in results[0]:  # FSDP2 shards every param (adapters too) on dim 0 of the data-parallel axis
        dp = r["mesh_dims"].index("fsdp" if spmd_backend == "partial_dtensor" else "dp_shard")
        assert all(p[dp] == "S(0)" for p in r["placements"].values()), r["placements"]


@pytest.mark.parametrize("spmd_backend", BACKENDS)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sp"])
def test_tp2(tmp_path, sp: bool, spmd_backend: str) -> None:
    results = run_ranks(tmp_path, "tp", spmd_backend, sp=sp)
    check(results)
    for r in results[0]:
        tp = r["mesh_dims"].index("tp")
        for name, placements in r["placements"].items():
            leaf, param = name.rsplit(".", 2)[-2:]
            rowwise = leaf in ("wo", "w2")
            want = {("lora_A", False): "R", ("lora_B", False): "S(0)",
                    ("lora_A", True): "S(1)", ("lora_B", True): "R"}[(param, rowwise)]
            # FSDP2 wraps even at data-parallel degree 1 (apply_fsdp_to_decoder always runs), so the
            # adapters are DTensors over (data-parallel, tp); the dp axis of a TP-sharded dim 0 shows as
            # _StridedShard. The gradient is placed as the param.
            assert placements[tp] == want, (name, r["mesh_dims"], placements)
            tp_long = {"R": "Replicate()", "S(0)": "Shard(dim=0)", "S(1)": "Shard(dim=1)"}[want]
            assert placements[-1].endswith(f"{tp_long})"), (name, placements)


@pytest.mark.parametrize("mode", ["fsdp", "tp"])
def test_spmd_types_backend_fails_on_this_torch(tmp_path, mode: str) -> None:
    """0.3.0's default backend: `Module.parallelize` annotates plain tensors (spmd_types), and torch
    2.13's fully_shard, given `dp_mesh_dims`, wants DTensors. Fails without LoRA too (see the report)."""
    results = run_ranks(tmp_path, mode, "spmd_types")
    errors = {r.get("error", "") for per_rank in results for r in per_rank}
    assert any("all parameters must be DTensors on the full SPMD mesh" in e for e in errors), errors


@pytest.mark.parametrize("mode", ["fsdp", "tp"])
def test_replicated_adapters(tmp_path, mode: str) -> None:
    """titan_lora's `[lora] replicate_adapters` (its default): adapters outside FSDP, whole on each
    data-parallel rank (plain tensors under FSDP=2, TP DTensors on the tp mesh under TP=2)."""
    results = run_ranks(tmp_path, mode, "partial_dtensor", replicate=True)
    check(results)
    for r in results[0]:
        for name, placements in r["placements"].items():
            if mode == "fsdp":
                assert placements == ["grad:"], (name, placements)  # plain tensors, plain grads
            else:
                leaf, param = name.rsplit(".", 2)[-2:]
                want = {("lora_A", False): "R", ("lora_B", False): "S(0)",
                        ("lora_A", True): "S(1)", ("lora_B", True): "R"}[(param, leaf in ("wo", "w2"))]
                assert r["mesh_dims"] == ["tp"] and placements[0] == want, (name, placements)
