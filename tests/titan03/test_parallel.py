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


def run_ranks(tmp_path, mode: str, spmd_backend: str = "partial_dtensor", sp: bool = False) -> list[list[dict]]:
    mp.spawn(worker, args=(WORLD, free_port(), mode, spmd_backend, sp, str(tmp_path)), nprocs=WORLD, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]


def check(results: list[list[dict]]) -> None:
    for rank, per_family in enumerate(results):
        for r in per_family:
            assert "error" not in r, f"rank {rank}: {r.get('traceback')}"
            print(f"rank {rank} {r['family']}: loss {r['loss']:.6f} vs one rank {r['ref_loss']:.6f} "
                  f"(diff {r['loss_diff']:.2g}), adapter grads max|diff| {r['grad_diff']:.2g} "
                  f"(|grad| max {r['grad_max']:.2g}), logits {r['logits_type']}{r['logits_placements']}")
            assert r["loss_diff"] < 1e-5
            assert r["grad_diff"] < 1e-5
            assert not r["missing_grads"]
            assert r["n_adapters"] == 2 * 7 * 2
            assert all(n.endswith(("lora_A", "lora_B")) for n in r["trainable"]) and len(r["trainable"]) == 28


def test_fsdp2(tmp_path) -> None:
    results = run_ranks(tmp_path, "fsdp")
    check(results)
    for r in results[0]:  # FSDP2 shards every param (adapters too) on dim 0 of the fsdp mesh
        assert all(p[:-1] == ["S(0)"] for p in r["placements"].values()), r["placements"]


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sp"])
def test_tp2(tmp_path, sp: bool) -> None:
    results = run_ranks(tmp_path, "tp", sp=sp)
    check(results)
    for r in results[0]:
        for name, placements in r["placements"].items():
            leaf, param = name.rsplit(".", 2)[-2:]
            rowwise = leaf in ("wo", "w2")
            want = {("lora_A", False): "R", ("lora_B", False): "S(0)",
                    ("lora_A", True): "S(1)", ("lora_B", True): "R"}[(param, rowwise)]
            # 2-D DTensors (fsdp of size 1, tp): FSDP2 still wraps (apply_fsdp_to_decoder always runs)
            # (the fsdp axis shows as _StridedShard on a TP-sharded dim 0); the tp placement is the last
            assert placements[1] == want, (name, placements)
            tp_long = {"R": "Replicate()", "S(0)": "Shard(dim=0)", "S(1)": "Shard(dim=1)"}[want]
            assert placements[2].endswith(f", {tp_long})"), (name, placements)  # the grad is placed alike
