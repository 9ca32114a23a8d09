"""The GRPO objective's engine calls go through the syncer's recovery; eval failures never end the run."""

from __future__ import annotations

import pytest
import torch

from titan_lora.clients.rollout import Completion
from titan_lora.config import GRPO
from titan_lora.rl.objective import GRPOObjective
from titan_lora.rl.sample_source import sample_source
from titan_lora.rl.task import build_task
from titan_lora.sync.engine_access import EngineRollouts
from titan_lora.sync.versions import AdapterVersions
from titan_lora.titan.parallel import DataParallelInfo
from titan_lora.transfer.errors import TransferError


class FakeClient:
    """Greedy answers: right for the prompts in `answers`, "99" otherwise; sampling answers "5"."""

    def __init__(self, answers: dict[tuple[int, ...], str]) -> None:
        self.answers = answers

    def generate(self, prompts, adapter, max_tokens, temperature, seed, stop):
        texts = [self.answers.get(tuple(p), "99") if temperature == 0 else "5" for p in prompts]
        return [Completion([7, 8], t, [-0.1, -0.2]) for t in texts]


class FakeSyncer:
    """Records what runs through `with_engine`; `failing` makes it give up as after its restarts."""

    def __init__(self, failing: bool = False) -> None:
        self.failing = failing
        self.calls: list[str] = []
        self.rollouts = FakeClient({})
        self.versions = AdapterVersions("policy", 2)
        self.versions.publish(4)
        self.last_metrics: dict[str, float] = {}

    def with_engine(self, fn, what: str):
        self.calls.append(what)
        if self.failing:
            raise TransferError("the engine failed after 3 restarts")
        return fn()


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def _objective(tokenizer, syncer: FakeSyncer) -> GRPOObjective:
    cfg = GRPO(enabled=True, prompts_per_step=2, group_size=2, max_new_tokens=4, eval_size=6, eval_every=5)
    engine = EngineRollouts(syncer.rollouts, syncer.versions, syncer.with_engine)
    return GRPOObjective(cfg, build_task(cfg), tokenizer, engine, DataParallelInfo(0, 1, None), torch.device("cpu"), None,
                         sample_source(cfg))


def test_rollouts_run_through_the_engine_recovery(tokenizer) -> None:
    syncer = FakeSyncer()
    samples = _objective(tokenizer, syncer)._samples(5)
    assert syncer.calls == ["rollouts of step 5"]
    assert len(samples) == 4 and {s.version for s in samples} == {4}


def test_a_rollout_failure_after_recovery_ends_the_step(tokenizer) -> None:
    syncer = FakeSyncer(failing=True)
    with pytest.raises(TransferError, match="after 3 restarts"):
        _objective(tokenizer, syncer).loss(None, 5)
    assert syncer.calls == ["rollouts of step 5"]


def test_eval_runs_through_the_recovery_and_its_failures_are_counted_not_raised(tokenizer) -> None:
    syncer = FakeSyncer()
    objective = _objective(tokenizer, syncer)
    right = {tuple(ids): str(p.answer) for ids, p in zip(objective.heldout_ids, objective.heldout)}
    syncer.rollouts.answers = {k: v for i, (k, v) in enumerate(right.items()) if i < 3}  # 3 of 6 right
    evals = lambda step: {k: v for k, v in objective.after_step(step).items() if k.startswith("eval/")}  # noqa: E731
    assert evals(5) == {"eval/accuracy": 0.5, "eval/failures": 0}
    assert evals(4) == {}, "eval_every = 5: no eval at step 4"
    syncer.failing = True
    assert evals(10) == {"eval/failures": 1}
    assert evals(15) == {"eval/failures": 2}
    assert syncer.calls == ["held-out eval at step 5", "held-out eval at step 10", "held-out eval at step 15"]
