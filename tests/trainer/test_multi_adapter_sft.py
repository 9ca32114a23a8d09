"""Several `[[adapters]]` trained together in one SFT job through the trainer (`TrainingRun`): three adapters
with different ranks, alphas, targets, learning rates, max norms, data and data seeds, 10 steps, end with the
weights each gets trained alone in a one-adapter job on its own data on 1 rank (float32, <= 1e-6), when
trained together on 1 rank, on 2 FSDP ranks (adapters replicated, and sharded by FSDP) and under TP=2 (the
base: a tiny random Llama checkpoint with SmolLM2's tokenizer, written once, so every layout loads the same). In the same run one adapter's gradient is
clipped at every step (its max norm is tiny: one norm over all adapters would scale the others' updates too)
and another's gradient is NaN at one step (it alone skips that step; the others are unaffected)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from dist_helpers import run_ranks
from model_helpers import SFT_SECTIONS, TP2, job_config_from, train_and_save, weights_by_adapter
from tiny_checkpoints import SMOLLM2_VOCAB, hf_toml, tiny_llama


REPO = Path(__file__).resolve().parents[2]
STEPS = 10
BATCH = 4  # rows per adapter per step (SmolLM2's 49k-token head makes each row cost)
NAN_STEP = 3
ADAPTERS = [  # name, rank, alpha, targets, lr, max_norm, data seed
    ("tiny_norm", 4, 8, '"all-linear"', 1e-3, 1e-4, 1),
    ("attn", 8, 4, '["wq", "wv"]', 5e-4, 1.0, 2),
    ("nan_once", 2, 16, '["w2", "wo"]', 2e-3, 1.0, 3),
]
SECTIONS = SFT_SECTIONS + """
[checkpoint]
enable = false
"""


def table(name: str, rank: int, alpha: int, targets: str, lr: float, max_norm: float, seed: int,
          data: Path) -> str:
    """One `[[adapters]]` table."""
    return (f'[[adapters]]\nname = "{name}"\nrank = {rank}\nalpha = {alpha}\ntarget_modules = {targets}\n'
            f'lr = {lr}\nmax_norm = {max_norm}\ndata_path = "{data}"\ndata_seed = {seed}\n')


def split_data(tmp: Path) -> list[Path]:
    """Each adapter its own 64 examples of the shipped arithmetic SFT data."""
    lines = (REPO / "titan_lora/data/arith_sft.jsonl").read_text().splitlines()
    paths = []
    for k in range(len(ADAPTERS)):
        path = tmp / f"data{k}.jsonl"
        path.write_text("\n".join(lines[64 * k: 64 * (k + 1)]) + "\n")
        paths.append(path)
    return paths


def _train(rank: int, world: int, toml: str, dump: str, out: str, nan_adapter: int | None,
           *layout: str) -> None:
    from titan_lora.train import TrainingRun

    data_parallel = world // (2 if "--parallelism.tensor_parallel_degree=2" in layout else 1)
    cfg = job_config_from(toml, f"--job.dump_folder={dump}", f"--training.global_batch_size={BATCH}",
                          f"--training.local_batch_size={BATCH // data_parallel}", f"--training.steps={STEPS}", "--lora.export_dir=", *layout)
    import titan_lora.train as train_module

    run = TrainingRun(cfg)
    try:
        if nan_adapter is not None:  # that adapter's gradient NaN at NAN_STEP, as the loop clips it
            clip = train_module.clip_per_adapter

            def clip_with_a_nan(groups, *args):
                if run.step == NAN_STEP:
                    for param in groups[nan_adapter]["params"]:
                        param.grad.fill_(float("nan"))
                return clip(groups, *args)

            train_module.clip_per_adapter = clip_with_a_nan
        train_and_save(run, rank, out)
    finally:
        run.close()


def _job(tmp: Path, job: str, name: str, tables: str, nan_adapter: int | None, world: int,
         layout: tuple[str, ...]) -> dict:
    out = tmp / f"{name}.pt"
    run_ranks(world, _train, job + tables, str(tmp / name), str(out), nan_adapter, *layout)
    return torch.load(out)


@dataclasses.dataclass
class Setup:
    job: str
    tables: list[str]
    alone: list[dict]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, smollm2_dir) -> Setup:
    """The job text on a tiny checkpoint made here, the tables, and adapters 0 and 1 each trained alone on 1 rank."""
    tmp = tmp_path_factory.mktemp("multi_sft")
    job = hf_toml("llama3", tiny_llama(tmp / "tiny", vocab=SMOLLM2_VOCAB, tokenizer_from=smollm2_dir)) + SECTIONS
    tables = [table(*spec, data=path) for spec, path in zip(ADAPTERS, split_data(tmp))]
    return Setup(job, tables, [_job(tmp, job, f"alone{k}", tables[k], None, 1, ()) for k in (0, 1)])


SHARDED = ("--lora.no_replicate_adapters",)
LAYOUTS = {"1 rank": (1, ()), "2 FSDP ranks": (2, ()), "2 FSDP ranks, sharded adapters": (2, SHARDED),
           "TP=2": (2, TP2)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_three_adapters_trained_together_end_as_each_trained_alone(setup: Setup, tmp_path: Path,
                                                                   layout: str) -> None:
    world, overrides = LAYOUTS[layout]
    together = _job(tmp_path, setup.job, "together", "".join(setup.tables), 2, world, overrides)
    alone = setup.alone

    by_adapter = weights_by_adapter(together["weights"])
    for k in (0, 1):
        ours, theirs = by_adapter[k], alone[k]["weights"]
        assert sorted(ours) == sorted(theirs), f"adapter {k}: other targets than its one-adapter job"
        diff = max(float((ours[n] - theirs[n]).abs().max()) for n in ours)
        assert diff <= 1e-6, f"{layout}: adapter {ADAPTERS[k][0]} differs from its one-adapter job by {diff:.2e}"
        moved = max(float(theirs[n].abs().max()) for n in theirs if ".lora_B" in n)
        assert moved > 1e-4, f"adapter {ADAPTERS[k][0]} barely trained: the comparison proves nothing"
    # Each adapter's loss and gradient norm is its own job's: the clipped one's norm is far above its bound.
    metrics = together["metrics"]
    for k in (0, 1):
        name = ADAPTERS[k][0]
        ours = [m[f"{name}/loss"] for m in metrics]
        theirs = [m["loss"] for m in alone[k]["metrics"]]
        assert max(abs(a - b) for a, b in zip(ours, theirs)) <= 1e-5, (name, ours, theirs)
    assert min(m["tiny_norm/grad_norm"] for m in metrics) > 100 * ADAPTERS[0][5]
    # The NaN step: that adapter alone skipped it and stayed finite.
    nan_norms = [m["nan_once/grad_norm"] for m in metrics]
    assert [s + 1 for s, n in enumerate(nan_norms) if n != n] == [NAN_STEP], nan_norms
    assert all(torch.isfinite(v).all() for v in by_adapter[2].values())
