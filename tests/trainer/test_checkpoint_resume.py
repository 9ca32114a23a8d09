"""Adapter checkpoints: a run resumed from step 2 reproduces steps 3 and 4 of the uninterrupted run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_helpers import run_ranks
from model_helpers import DEBUG_LORA, full_adapter, job_config_from

from titan_lora.lora.layer import adapter_params
from titan_lora.trainer.checkpoint import SIGNATURE_FILE

PEFT_Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"

REPO = Path(__file__).resolve().parents[2]
TRAIN = DEBUG_LORA + """
[optimizer]
name = "AdamW"
lr = 1e-2
weight_decay = 0.0
[lr_scheduler]
warmup_steps = 1
[checkpoint]
enable = true
folder = "checkpoint"
interval = 2
keep_latest_k = 0
"""


def _train(rank: int, world: int, dump: str, out: str, same_base_for_any_world: bool = False,
           *overrides: str) -> None:
    from test_train_parity import _seeded_base

    from titan_lora.train import TrainingRun

    cfg = job_config_from(
        TRAIN, f"--job.dump_folder={dump}", "--training.steps=4", "--training.global_batch_size=8",
        "--training.local_batch_size=4", f"--data.path={REPO / 'titan_lora/data/arith_sft.jsonl'}",
        *overrides,
    )
    run = TrainingRun(cfg)
    if same_base_for_any_world:  # torchtitan's random init of the base depends on the sharding
        _seeded_base(run.model)
    start = run.step
    losses: dict[int, float] = {}
    lrs: dict[int, float] = {}
    log = run.metrics.log

    def record(step: int, scalars) -> None:
        losses[step] = scalars["train/loss"]
        lrs[step] = scalars["train/lr"]
        log(step, scalars)

    run.metrics.log = record
    try:
        run.train()
        final = full_adapter(adapter_params(run.model))
    finally:
        run.close()
    if rank == 0:
        torch.save({"start": start, "losses": losses, "lrs": lrs, "final": final}, out)


def test_resume_from_step_2_reproduces_steps_3_and_4(tmp_path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    run_ranks(2, _train, str(first), str(tmp_path / "first.pt"))
    full = torch.load(tmp_path / "first.pt")
    assert full["start"] == 0 and sorted(full["losses"]) == [1, 2, 3, 4]
    saved = sorted(p.name for p in (first / "checkpoint").iterdir())
    assert saved == ["step-2", "step-4"], f"interval 2 over 4 steps, keep_latest_k = 0 (all): steps 2 and 4, got {saved}"
    # The SFT run, [lora] export_dir left out, exported its adapter under its dump folder.
    exported = sorted(p.name for p in (first / "adapter").iterdir())
    assert exported == ["adapter_config.json", "adapter_model.safetensors"], exported
    assert json.loads((first / "adapter" / "adapter_config.json").read_text())["r"] == 8
    losses = full["losses"]
    assert len({round(v, 6) for v in losses.values()}) == 4, f"losses should move step to step: {losses}"

    # Stored under PEFT's names (they survive torchtitan's module renames), with the signature saying so.
    keys = set(dcp.FileSystemReader(str(first / "checkpoint" / "step-2")).read_metadata().state_dict_metadata)
    assert "adapter." + PEFT_Q_A in keys and "optimizer.state." + PEFT_Q_A + ".exp_avg" in keys, sorted(keys)[:8]
    assert not [k for k in keys if "attention.qkv_linear.wq" in k], "a torchtitan module path in the checkpoint"
    signature = json.loads((first / "checkpoint" / "step-2" / SIGNATURE_FILE).read_text())
    assert signature["names"] == "peft" and signature["row_order"] == "torchtitan-interleaved-rope"
    assert signature["targets"] == "hf" and "model.layers.1.mlp.down_proj" in signature["target_modules"]

    # Start the second run from the step-2 checkpoint alone, its signature as titan_lora wrote it on
    # torchtitan 0.2.2 (the same tensors, the targets listed by 0.2.2's module paths): it resumes.
    shutil.copytree(first / "checkpoint" / "step-2", second / "checkpoint" / "step-2")
    (second / "checkpoint" / "step-2" / SIGNATURE_FILE).write_text(json.dumps(
        {**{k: v for k, v in signature.items() if k != "targets"}, "target_modules": ALL_LINEARS}))
    run_ranks(2, _train, str(second), str(tmp_path / "second.pt"))
    resumed = torch.load(tmp_path / "second.pt")

    assert resumed["start"] == 2, "the resumed run must continue at the checkpoint's step"
    assert sorted(resumed["losses"]) == [3, 4], "a resumed run trains only the remaining steps"
    print("uninterrupted:", {k: f"{v:.7f}" for k, v in losses.items()},
          "resumed:", {k: f"{v:.7f}" for k, v in resumed["losses"].items()})
    for step in (3, 4):
        assert resumed["losses"][step] == losses[step], f"step {step}: {resumed['losses'][step]} != {losses[step]}"
        assert resumed["lrs"][step] == full["lrs"][step], f"step {step}: the LR schedule was not restored"
    for name, value in full["final"].items():
        assert torch.equal(resumed["final"][name], value), f"{name} differs after the resumed run"


def _train_saving_torchtitan_022_names(rank: int, world: int, dump: str, out: str) -> None:
    """`_train`, its checkpoints written as titan_lora wrote them on torchtitan 0.2.2 before PEFT names: keyed
    by 0.2.2's module paths (`layers.0.attention.wq.lora_A`), the signature listing those paths."""
    from titan_lora.lora.layer import lora_modules
    from titan_lora.trainer.checkpoint import AdapterCheckpointer
    from titan_lora.trainer.checkpoint_names import to_torchtitan_022

    state, signature = AdapterCheckpointer._state, AdapterCheckpointer._signature
    AdapterCheckpointer._state = lambda self, step, peft_named=True: state(self, step, False)
    AdapterCheckpointer._signature = lambda self: {
        "lora_rank": signature(self)["lora_rank"],
        "target_modules": sorted(to_torchtitan_022(name) for name, _ in lora_modules(self.model))}
    _train(rank, world, dump, out)


def test_a_checkpoint_keyed_by_torchtitan_022_module_paths_still_resumes(tmp_path) -> None:
    """Checkpoints saved before PEFT names (torchtitan 0.2.2's paths, no `names` in the signature)."""
    old, new = tmp_path / "old", tmp_path / "new"
    run_ranks(2, _train_saving_torchtitan_022_names, str(old), str(tmp_path / "old.pt"))
    keys = set(dcp.FileSystemReader(str(old / "checkpoint" / "step-2")).read_metadata().state_dict_metadata)
    assert "adapter.layers.0.attention.wq.lora_A" in keys, sorted(keys)[:8]
    assert "optimizer.state.layers.1.attention.wv.lora_B.exp_avg" in keys, sorted(keys)[:8]
    signature = json.loads((old / "checkpoint" / "step-2" / SIGNATURE_FILE).read_text())
    assert "layers.0.attention.wq" in signature["target_modules"] and "names" not in signature
    full = torch.load(tmp_path / "old.pt")
    shutil.copytree(old / "checkpoint" / "step-2", new / "checkpoint" / "step-2")
    run_ranks(2, _train, str(new), str(tmp_path / "new.pt"))
    resumed = torch.load(tmp_path / "new.pt")
    assert resumed["start"] == 2 and sorted(resumed["losses"]) == [3, 4]
    assert all(resumed["losses"][s] == full["losses"][s] for s in (3, 4)), (resumed["losses"], full["losses"])
    for name, value in full["final"].items():
        assert torch.equal(resumed["final"][name], value), f"{name} differs after the resumed run"
    keys = set(dcp.FileSystemReader(str(new / "checkpoint" / "step-4")).read_metadata().state_dict_metadata)
    assert "adapter." + PEFT_Q_A in keys, "the next checkpoint uses PEFT names"


def test_a_checkpoint_of_one_rank_resumes_on_two(tmp_path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    run_ranks(1, _train, str(one), str(tmp_path / "one.pt"), True)
    full = torch.load(tmp_path / "one.pt")
    shutil.copytree(one / "checkpoint" / "step-2", two / "checkpoint" / "step-2")
    run_ranks(2, _train, str(two), str(tmp_path / "two.pt"), True)
    resumed = torch.load(tmp_path / "two.pt")
    assert resumed["start"] == 2 and sorted(resumed["losses"]) == [3, 4]
    for step in (3, 4):  # 1 vs 2 ranks: the same sums in another order
        assert abs(resumed["losses"][step] - full["losses"][step]) <= 1e-5 * abs(full["losses"][step])
        assert resumed["lrs"][step] == full["lrs"][step]
    for name, value in full["final"].items():
        torch.testing.assert_close(resumed["final"][name], value, rtol=1e-4, atol=1e-6, msg=name)


def test_a_checkpoint_of_fsdp_sharded_adapters_resumes_with_replicated_ones(tmp_path) -> None:
    """A checkpoint saved before `[lora] replicate_adapters` became the default (adapters as FSDP DTensors)
    resumes into replicated adapters: DCP reshards the adapter and its optimizer state."""
    sharded, replicated = tmp_path / "sharded", tmp_path / "replicated"
    run_ranks(2, _train, str(sharded), str(tmp_path / "sharded.pt"), False, "--lora.no_replicate_adapters")
    full = torch.load(tmp_path / "sharded.pt")
    shutil.copytree(sharded / "checkpoint" / "step-2", replicated / "checkpoint" / "step-2")
    run_ranks(2, _train, str(replicated), str(tmp_path / "replicated.pt"))
    resumed = torch.load(tmp_path / "replicated.pt")
    assert resumed["start"] == 2 and sorted(resumed["losses"]) == [3, 4]
    for step in (3, 4):  # the same sums, reduced by an all-reduce instead of a reduce-scatter
        assert abs(resumed["losses"][step] - full["losses"][step]) <= 1e-5 * abs(full["losses"][step])
        assert resumed["lrs"][step] == full["lrs"][step]
    for name, value in full["final"].items():
        torch.testing.assert_close(resumed["final"][name], value, rtol=1e-4, atol=1e-6, msg=name)


def _fake_checkpoint(dump: Path, step: int, rank: int, targets: list[str], hf_names: bool = False) -> Path:
    path = dump / "checkpoint" / f"step-{step}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    signature = {"lora_rank": rank, "target_modules": targets, **({"targets": "hf"} if hf_names else {})}
    (path / "titan_lora_adapter.json").write_text(json.dumps(signature))
    return path


ALL_LINEARS = [f"layers.{i}.{m}" for i in range(2) for m in (
    "attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
    "feed_forward.w3")]
"""The debug model's linears as a signature written on torchtitan 0.2.2 lists them."""
ALL_HF_LINEARS = [f"model.layers.{i}.{m}" for i in range(2) for m in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
    "mlp.down_proj", "mlp.up_proj")]
"""The same as a signature lists them now: HF module names."""


def test_a_resume_with_another_rank_or_other_targets_is_refused_before_the_build(tmp_path) -> None:
    args = (f"--job.dump_folder={tmp_path}",)
    _fake_checkpoint(tmp_path, 1, 8, ALL_HF_LINEARS, hf_names=True)
    assert job_config_from(TRAIN, *args).lora.rank == 8, "the same rank and targets resume"
    _fake_checkpoint(tmp_path, 2, 8, ALL_LINEARS)
    assert job_config_from(TRAIN, *args).lora.rank == 8, "the same, listed by torchtitan 0.2.2's paths, resume"
    newest = _fake_checkpoint(tmp_path, 4, 16, ALL_LINEARS)
    with pytest.raises(ValueError) as err:
        job_config_from(TRAIN, *args)
    expected = f"cannot resume from {newest}: it was saved with [lora] rank = 16, this job has rank = 8"
    assert expected in str(err.value)
    assert "another [checkpoint] folder" in str(err.value)
    shutil.rmtree(newest)
    newest = _fake_checkpoint(tmp_path, 6, 8, [n for n in ALL_LINEARS if "attention" in n])
    with pytest.raises(ValueError, match=r"saved with other \[lora\] target_modules .*model.layers.0.mlp.down_proj"):
        job_config_from(TRAIN, *args)
    shutil.rmtree(newest)
    _fake_checkpoint(tmp_path, 8, 8, [n for n in ALL_HF_LINEARS if "q_proj" not in n], hf_names=True)
    with pytest.raises(ValueError, match=r"saved with other \[lora\] target_modules .*model.layers.0.self_attn.q_proj"):
        job_config_from(TRAIN, *args)


def test_a_resume_with_no_steps_left_is_refused_before_the_build(tmp_path) -> None:
    args = (f"--job.dump_folder={tmp_path}", "--training.steps=3")
    _fake_checkpoint(tmp_path, 2, 8, ALL_LINEARS)
    assert job_config_from(TRAIN, *args).training.steps == 3, "step 2 of 3: one step is left"
    newest = _fake_checkpoint(tmp_path, 3, 8, ALL_LINEARS)
    with pytest.raises(ValueError) as err:
        job_config_from(TRAIN, *args)
    assert f"nothing to train: {newest} is step 3 and [training] steps = 3" in str(err.value)
    assert "raise --training.steps above 3" in str(err.value)
    assert job_config_from(TRAIN, *args[:1], "--training.steps=4").training.steps == 4
