"""A NaN adapter never spreads: the collective check after every optimizer step,
`on_nonfinite = "stop" | "rollback"`, the explicit sync call, and checkpoints that refuse NaN."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dist_helpers import run_ranks
from model_helpers import DEBUG_LORA, full_adapter, job_config_from
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from titan_lora.compose import EngineSide
from titan_lora.lora.layer import adapter_params

REPO = Path(__file__).resolve().parents[2]
NAN_STEP = 3
FIRST_ADAPTER = "layers.0.attention.qkv_linear.wq.lora_A"  # the first adapter tensor in module order


def _toml(policy: str, export_dir: Path) -> str:
    return DEBUG_LORA.replace("[lora]\n", f'[lora]\nexport_dir = "{export_dir}"\n').replace(
        "[training]\n", f'[training]\non_nonfinite = "{policy}"\n') + """
[optimizer]
name = "AdamW"
lr = 1e-2
[lr_scheduler]
warmup_steps = 1
[checkpoint]
enable = true
folder = "checkpoint"
interval = 2
keep_latest_k = 1
[weight_sync]
enabled = true
"""


class FakeSyncer:
    """Stands in for the engine sync: records the versions it is asked to sync."""

    def __init__(self) -> None:
        self.versions: list[int] = []
        self.last_metrics: dict[str, float] = {}

    def sync(self, version: int) -> dict[str, float]:
        self.versions.append(version)
        return {}

    def close(self) -> None:
        pass


def _run(policy: str, dump: Path, nan_step: int = NAN_STEP):
    """A 5-step SFT run whose loss turns NaN at `nan_step`; records what it logs."""
    import titan_lora.train as train

    syncer = FakeSyncer()
    train.engine_side = lambda job_config, built, device: EngineSide()  # no engine: the syncer is a fake
    train.build_sync = lambda job_config, adapter, built, device, side, task: (syncer, None)
    cfg = job_config_from(
        _toml(policy, dump / "adapter"), f"--job.dump_folder={dump}", "--training.steps=5",
        "--training.global_batch_size=8", "--training.local_batch_size=4",
        f"--data.path={REPO / 'titan_lora/data/arith_sft.jsonl'}",
    )
    run = train.TrainingRun(cfg)
    clean_loss = run.objective.loss
    run.objective.loss = lambda model, step: (lambda lm: (lm[0] * float("nan") if step == nan_step else lm[0],
                                                          lm[1]))(clean_loss(model, step))
    logged: dict[int, dict] = {}
    log = run.metrics.log

    def record(step: int, scalars) -> None:  # every rank logs: the gather is collective
        logged[step] = {**scalars, "adapter": full_adapter(adapter_params(run.model))}
        log(step, scalars)

    run.metrics.log = record
    return run, syncer, logged


def _rollback_then_stop(rank: int, world: int, root: str, out: str) -> None:
    from titan_lora.lora.finite import NonFiniteAdapterError, first_nonfinite_adapter

    root = Path(root)
    result = {}
    run, syncer, logged = _run("rollback", root / "rollback")
    run.train()
    run.close()
    result["rollback"] = {"synced": syncer.versions, "logged": logged}
    # Only rank 1's shard of the third adapter tensor turns NaN: every rank must learn its name.
    name, param = adapter_params(run.model)[2]
    if rank == 1:
        with torch.no_grad():
            (param.to_local() if isinstance(param, DTensor) else param)[0, 0] = float("nan")
    result["one_rank_nan"] = (name, first_nonfinite_adapter(run.model))

    run, syncer, _ = _run("stop", root / "stop")
    with pytest.raises(NonFiniteAdapterError) as stopped:
        run.train()
    result["stop"] = {"synced": syncer.versions, "error": str(stopped.value)}
    with pytest.raises(NonFiniteAdapterError) as refused:
        run.checkpointer.save(NAN_STEP)  # a second line: a save of a NaN adapter is refused
    result["save_refused"] = str(refused.value)
    run.close()

    run, _, _ = _run("rollback", root / "early", nan_step=1)  # before the first checkpoint
    with pytest.raises(NonFiniteAdapterError) as early:
        run.train()
    result["no_checkpoint"] = str(early.value)
    run.close()
    torch.save(result, f"{out}.{rank}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("nonfinite")
    run_ranks(2, _rollback_then_stop, str(root), str(root / "result.pt"))
    return root, [torch.load(root / f"result.pt.{r}") for r in range(2)]


def test_rollback_reloads_the_last_checkpoint_skips_the_batch_and_finishes(runs) -> None:
    root, results = runs
    logged = results[0]["rollback"]["logged"]
    assert sorted(logged) == [1, 2, 3, 4, 5], "the run goes on after the rollback"
    for name, value in logged[NAN_STEP]["adapter"].items():
        assert torch.equal(value, logged[2]["adapter"][name]), f"{name}: step 3 did not restore step 2's"
    assert logged[2]["train/lr"] != logged[1]["train/lr"], "the schedule should move step to step"
    assert logged[NAN_STEP]["train/lr"] == logged[2]["train/lr"], "the LR schedule was not restored"
    assert [logged[s]["train/nonfinite_rollbacks"] for s in (2, 3, 4)] == [0, 1, 1]
    assert not torch.equal(logged[4]["adapter"][FIRST_ADAPTER], logged[2]["adapter"][FIRST_ADAPTER])
    for step in (4, 5):
        assert all(torch.isfinite(t).all() for t in logged[step]["adapter"].values())
    for r in range(2):  # sync after every step, the rolled-back one included, on every rank
        assert results[r]["rollback"]["synced"] == [0, 1, 2, 3, 4, 5]
    assert sorted(p.name for p in (root / "rollback/checkpoint").iterdir()) == ["step-5"]
    exported = load_file(root / "rollback/adapter/adapter_model.safetensors")
    assert exported and all(torch.isfinite(t).all() for t in exported.values())


def test_every_rank_learns_of_a_nan_in_one_rank_shard(runs) -> None:
    _, results = runs
    for r in range(2):
        name, found = results[r]["one_rank_nan"]
        assert found == name and name.endswith("lora_A"), (r, name, found)


def test_stop_raises_on_every_rank_naming_step_and_tensor_and_keeps_the_last_checkpoint(runs) -> None:
    root, results = runs
    for r in range(2):
        error = results[r]["stop"]["error"]
        assert f"step {NAN_STEP}: adapter tensor {FIRST_ADAPTER} holds NaN/Inf" in error, error
        assert 'on_nonfinite = "stop"' in error
        assert results[r]["stop"]["synced"] == [0, 1, 2], "a non-finite adapter must not be synced"
    ckpt = root / "stop/checkpoint"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-2"], "the last finite checkpoint was pruned"
    assert (ckpt / "step-2/.metadata").exists()
    signature = json.loads((ckpt / "step-2/titan_lora_adapter.json").read_text())
    assert signature["lora_rank"] == 8
    assert signature["targets"] == "hf" and "model.layers.0.self_attn.q_proj" in signature["target_modules"]
    assert len(signature["target_modules"]) == 2 * 7, "2 layers x 7 linears in the debug model"
    for r in range(2):
        assert f"refusing to save the checkpoint of step {NAN_STEP}" in results[r]["save_refused"]
    assert not (root / "stop/adapter").exists(), "a stopped run exports nothing"


def test_rollback_before_any_checkpoint_stops_naming_the_checkpoint_keys(runs) -> None:
    root, results = runs
    for r in range(2):
        error = results[r]["no_checkpoint"]
        assert "step 1: adapter tensor" in error and "no checkpoint to roll back to yet" in error, error
        assert "[checkpoint] enable = true" in error and "[checkpoint] interval" in error
    assert not (root / "early/checkpoint").exists()
