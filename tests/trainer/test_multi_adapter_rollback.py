"""`[training] on_nonfinite = "rollback"` with several adapters (`TrainingRun.handle_nonfinite`,
`AdapterCheckpointer.restore_adapter`): two adapters trained together by SFT on 2 FSDP ranks, checkpoints every
2 steps; after the optimizer step of step 3 one adapter's weight and Adam moments are made NaN. That adapter
alone goes back to the checkpoint of step 2 (its tensors exactly, its optimizer state: one rollback, not one
per later step), then trains on; the other ends exactly as in the same job with no NaN (its update of step 3,
its optimizer state, its learning rate and the schedule untouched). Sharded adapters (DTensors) and
replicated ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_helpers import run_ranks
from model_helpers import SFT_SECTIONS, full_copy, job_config_from, train_and_save, weights_by_adapter
from test_multi_adapter_sft import ADAPTERS, BATCH, split_data, table
from tiny_checkpoints import SMOLLM2_VOCAB, hf_toml, tiny_llama

STEPS = 4
BAD_STEP = 3
BAD = 1  # the adapter made NaN
SECTIONS = SFT_SECTIONS + """
[checkpoint]
enable = true
interval = 2
"""


def _train(rank: int, world: int, toml: str, dump: str, out: str, poison: bool, *layout: str) -> None:
    from titan_lora.lora.layer import adapter_params
    from titan_lora.lora.multi import adapter_of
    from titan_lora.train import TrainingRun

    cfg = job_config_from(toml, f"--job.dump_folder={dump}", f"--training.global_batch_size={BATCH}",
                          f"--training.local_batch_size={BATCH // world}", f"--training.steps={STEPS}",
                          "--training.on_nonfinite=rollback", "--lora.export_dir=", *layout)
    run = TrainingRun(cfg)
    seen: dict[int, dict[str, torch.Tensor]] = {}  # step -> the bad adapter's weights after its check
    check = run.check_and_sync

    def check_with_a_nan() -> dict[str, float]:
        bad = [(n, p) for n, p in adapter_params(run.model) if adapter_of(n) == BAD]
        if poison and run.step == BAD_STEP:
            (optimizer,) = run.optimizers.optimizers
            with torch.no_grad():
                for _, p in bad:
                    p.fill_(float("nan"))
                    optimizer.state[p]["exp_avg"].fill_(float("nan"))
        metrics = check()
        seen[run.step] = {n: full_copy(p) for n, p in bad}
        return metrics

    run.check_and_sync = check_with_a_nan
    try:
        train_and_save(run, rank, out)
        if rank == 0:
            saved = torch.load(out)
            torch.save({**saved, "seen": seen, "rollbacks": run.rollbacks}, out)
    finally:
        run.close()


@pytest.fixture(scope="module")
def job(tmp_path_factory, smollm2_dir) -> str:
    tmp = tmp_path_factory.mktemp("multi_rollback")
    text = hf_toml("llama3", tiny_llama(tmp / "tiny", vocab=SMOLLM2_VOCAB, tokenizer_from=smollm2_dir)) + SECTIONS
    return text + "".join(table(*spec, data=path) for spec, path in zip(ADAPTERS[:2], split_data(tmp)))


@pytest.mark.parametrize("layout", [(), ("--lora.no_replicate_adapters",)], ids=["replicated", "sharded"])
def test_a_nan_adapter_alone_rolls_back_and_the_other_goes_on_as_without_it(job: str, tmp_path: Path,
                                                                            layout: tuple[str, ...]) -> None:
    runs = {}
    for poison in (False, True):
        out = tmp_path / f"poison{poison}.pt"
        run_ranks(2, _train, job, str(tmp_path / f"run{poison}"), str(out), poison, *layout)
        runs[poison] = torch.load(out)
    clean, rolled = runs[False], runs[True]
    assert rolled["rollbacks"] == 1 and clean["rollbacks"] == 0, "one rollback: the adapter's optimizer state too"
    ours, theirs = weights_by_adapter(rolled["weights"]), weights_by_adapter(clean["weights"])
    diff = max(float((ours[0][n] - theirs[0][n]).abs().max()) for n in theirs[0])
    assert diff == 0, f"the other adapter differs from the same job without a NaN by {diff:.2e}"
    back, step2 = rolled["seen"][BAD_STEP], clean["seen"][BAD_STEP - 1]
    assert all(torch.equal(back[n], step2[n]) for n in step2), "the NaN adapter is not the checkpoint's of step 2"
    moved = max(float((rolled["seen"][STEPS][n] - back[n]).abs().max()) for n in back)
    assert moved > 0 and all(torch.isfinite(v).all() for v in ours[BAD].values()), "it did not train on after it"
    assert any(not torch.equal(ours[BAD][n], theirs[BAD][n]) for n in theirs[BAD]), "it skipped no update"
