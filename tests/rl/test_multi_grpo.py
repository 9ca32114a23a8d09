"""GRPO on several `[[adapters]]` in one job, through the trainer (`TrainingRun`), with `[grpo] rollouts = false`
(each step's samples are its task's answers and scrambled ones: no engine, the same samples on every run): two
adapters with different ranks, targets, learning rates, tasks (digits) and seeds, trained together for 4 steps,
end within 1e-6 (float32) of each trained alone in a one-adapter GRPO job: in one forward of both adapters' rows on
1 rank (`[grpo] adapter_batches = "one"`); in a forward and a backward per adapter on 2 FSDP ranks (the
replicated adapters' gradients summed over the ranks once, after the last backward); and per adapter with the
log-prob forward cut into row chunks (each chunk routed to its rows' adapter, and again in the backward's
recompute); and with the KL term against the base (every adapter off) in one forward and per adapter. The live path (rollouts of both adapters from one vLLM engine) is in
tests/rl/test_multi_grpo_live.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_helpers import run_ranks
from model_helpers import job_config_from, train_and_save, weights_by_adapter
from tiny_checkpoints import SMOLLM2_VOCAB, hf_toml, tiny_llama


STEPS = 4
GRPO = """
[grpo]
enabled = true
rollouts = false
prompts_per_step = 2
group_size = 4
max_new_tokens = 8
eval_every = 0
[checkpoint]
enable = false
"""
OVERRIDES = (f"--training.steps={STEPS}", "--training.max_norm=1.0", "--lora.export_dir=")
ADAPTERS = [  # name, rank, targets, lr, task digits, seed
    ("two_digit", 4, '"all-linear"', 2e-3, 2, 1),
    ("one_digit", 8, '["wq", "wv", "w2"]', 1e-3, 1, 7),
]


def table(name: str, rank: int, targets: str, lr: float, digits: int, seed: int) -> str:
    """One `[[adapters]]` table with its own GRPO task and seed."""
    return (f'[[adapters]]\nname = "{name}"\nrank = {rank}\nalpha = {2 * rank}\ntarget_modules = {targets}\n'
            f'lr = {lr}\ntask_digits = {digits}\nseed = {seed}\n')


def _train(rank: int, world: int, toml: str, dump: str, out: str, chunk_tokens: int | None, batches: str,
           extra: tuple[str, ...]) -> None:
    from titan_lora.compose import check_plugins
    from titan_lora.train import TrainingRun

    cfg = job_config_from(toml, f"--job.dump_folder={dump}", f"--grpo.adapter_batches={batches}", *OVERRIDES,
                          *extra)
    run = TrainingRun(cfg, check_plugins(cfg))
    if chunk_tokens is not None:  # so low a bound that each adapter's 8 rows run as several chunks
        run.objective.logprob_chunk_tokens = chunk_tokens
    if batches != "auto":
        assert run.objective.backward_each == (batches == "each")
    try:
        train_and_save(run, rank, out)
    finally:
        run.close()


def _job(tmp: Path, toml: str, name: str, world: int, chunk_tokens: int | None = None, batches: str = "auto",
         extra: tuple[str, ...] = ()) -> dict:
    out = tmp / f"{name}.pt"
    run_ranks(world, _train, toml, str(tmp / name), str(out), chunk_tokens, batches, extra)
    return torch.load(out)


@pytest.fixture(scope="module")
def alone(tmp_path_factory, smollm2_dir) -> tuple[str, list[dict]]:
    """The job text on a tiny checkpoint made here, and each adapter trained alone on 1 rank."""
    tmp = tmp_path_factory.mktemp("multi_grpo")
    job = hf_toml("llama3", tiny_llama(tmp / "tiny", vocab=SMOLLM2_VOCAB, tokenizer_from=smollm2_dir)) + GRPO
    return job, [_job(tmp, job + table(*spec), f"alone{k}", 1) for k, spec in enumerate(ADAPTERS)]


LAYOUTS = {"1 rank, one forward": (1, None, "one"), "2 FSDP ranks, a backward per adapter": (2, None, "each"),
           "1 rank, a backward per adapter, log-probs in row chunks": (1, 150, "each")}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_adapters_trained_together_with_grpo_end_as_each_trained_alone(alone, tmp_path: Path, layout: str) -> None:
    job, each = alone
    world, chunk_tokens, batches = LAYOUTS[layout]
    together = _job(tmp_path, job + "".join(table(*spec) for spec in ADAPTERS), "together", world, chunk_tokens,
                    batches)
    by_adapter = weights_by_adapter(together["weights"])
    for k, (name, *_rest) in enumerate(ADAPTERS):
        ours, theirs = by_adapter[k], each[k]["weights"]
        assert sorted(ours) == sorted(theirs), f"{name}: other targets than its one-adapter job"
        diff = max(float((ours[n] - theirs[n]).abs().max()) for n in ours)
        assert diff <= 1e-6, f"{layout}: adapter {name} differs from its one-adapter job by {diff:.2e}"
        moved = max(float(theirs[n].abs().max()) for n in theirs if ".lora_B" in n)
        assert moved > 1e-4, f"adapter {name} barely trained: the comparison proves nothing"
        ours_loss = [m[f"{name}/loss"] for m in together["metrics"]]
        theirs_loss = [m["loss"] for m in each[k]["metrics"]]
        assert max(abs(a - b) for a, b in zip(ours_loss, theirs_loss)) <= 1e-5, (name, ours_loss, theirs_loss)
        assert [m[f"{name}/rl/reward_mean"] for m in together["metrics"]] == \
            [m["rl/reward_mean"] for m in each[k]["metrics"]], f"{name}: other samples than its own job's"
    loss = [m["loss"] for m in together["metrics"]]
    assert loss == pytest.approx([sum(m[f"{n}/loss"] for n, *_ in ADAPTERS) for m in together["metrics"]])


KL = "--grpo.kl_coef=0.5"


def test_two_adapters_with_the_kl_term_end_as_each_trained_alone_with_it(alone, tmp_path: Path) -> None:
    """The KL reference is the base with every adapter off, K-adapter linears included (were they left on, the
    reference would be the policy itself and the KL zero)."""
    job, _ = alone
    each = [_job(tmp_path, job + table(*spec), f"alone_kl{k}", 1, extra=(KL,)) for k, spec in enumerate(ADAPTERS)]
    both = job + "".join(table(*spec) for spec in ADAPTERS)
    for batches in ("one", "each"):
        together = _job(tmp_path, both, f"together_kl_{batches}", 1, batches=batches, extra=(KL,))
        by_adapter = weights_by_adapter(together["weights"])
        for k, (name, *_rest) in enumerate(ADAPTERS):
            ours, theirs = by_adapter[k], each[k]["weights"]
            diff = max(float((ours[n] - theirs[n]).abs().max()) for n in ours)
            assert diff <= 1e-6, f"{batches}: adapter {name} differs from its one-adapter KL job by {diff:.2e}"
            kl = [m[f"{name}/rl/kl"] for m in together["metrics"]]
            assert kl == pytest.approx([m["rl/kl"] for m in each[k]["metrics"]], abs=1e-7), (name, kl)
            assert kl[0] == 0 and min(kl[1:]) > 1e-6, f"{name}: the KL term is not live: {kl}"
