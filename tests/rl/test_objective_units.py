"""GRPOObjective's remaining branches in one process: dtypes, the engine log-prob gap, the KL term against a
model whose adapter really moves the logits, the DP reductions (each all_reduce checked by slice, op and
group), the offline samples, held-out evaluation and its logging, after_step and the progress fields.
Hand-derived values throughout; the DP reductions use a fake all_reduce that plays a second, identical rank."""

from __future__ import annotations

import contextlib
import logging
import math

import pytest
import torch
import torch.nn as nn
from test_grpo_objective import (
    PAD,
    STEP,
    VOCAB,
    LogitTable,
    StubTokenizer,
    _hand_samples,
    _loss,
    _objective,
    _sample,
)

from titan_lora.config import GRPO
from titan_lora.rl import objective
from titan_lora.rl.objective import GRPOObjective, completion_batch
from titan_lora.rl.rollout import Sample
from titan_lora.rl.sample_source import sample_source
from titan_lora.rl.task import build_task
from titan_lora.sync.engine_access import EngineRollouts
from titan_lora.sync.versions import Lease
from titan_lora.titan.parallel import DataParallelInfo
from titan_lora.transfer.errors import TransferError

LN_V = math.log(VOCAB)  # a zero logit table is uniform: logp = -ln V everywhere


def _own(caplog: pytest.LogCaptureFixture) -> list[str]:
    """This module's log lines (other tests' background threads may log meanwhile)."""
    return [r.getMessage() for r in caplog.records if r.name == "titan_lora.rl.objective"]


def test_completion_batch_ids_are_long_integers() -> None:
    inputs, labels, mask = completion_batch([Sample([1, 2], [3], [], 0.0, 0.0, 0, "")], pad_id=PAD)
    assert inputs.dtype == labels.dtype == torch.long and mask.dtype == torch.float32


# ---- the engine log-prob gap ---------------------------------------------------------------------------


def test_the_engine_gap_compares_the_completion_positions_only() -> None:
    # prompt 1 2 3, completion 4 5: labels 4 and 5 sit at positions 2 and 3; the engine said -1 and -6 there
    s = Sample([1, 2, 3], [4, 5], [-1.0, -6.0], 1.0, 1.0, STEP - 1, "")
    _, metrics = _loss(_objective(), [s], LogitTable())
    gaps = [abs(-LN_V + 1.0), abs(-LN_V + 6.0)]
    assert metrics["rl/logprob_gap_max"] == pytest.approx(max(gaps), abs=1e-5)
    assert metrics["rl/logprob_gap_mean"] == pytest.approx(sum(gaps) / 2, abs=1e-5)


def test_without_rollouts_there_is_no_engine_gap() -> None:
    s = Sample([1, 2, 3], [4, 5], [-1.0, -6.0], 1.0, 1.0, STEP - 1, "")
    _, metrics = _loss(_objective(rollouts=False), [s], LogitTable())
    assert metrics["rl/logprob_gap_max"] == 0.0 and metrics["rl/logprob_gap_mean"] == 0.0


# ---- the KL term -----------------------------------------------------------------------------------------


class AdaptedTable(nn.Module):
    """logits = base[input] + (0 if the adapter is off else delta[input]); delta is the trainable part."""

    def __init__(self, delta: torch.Tensor) -> None:
        super().__init__()
        self.base = torch.zeros(VOCAB, VOCAB)
        self.delta = nn.Parameter(delta.clone())
        self.adapter_on = True

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.base[inputs] + (self.delta[inputs] if self.adapter_on else 0.0)


@contextlib.contextmanager
def _adapter_off(model: AdaptedTable):
    model.adapter_on = False
    try:
        yield
    finally:
        model.adapter_on = True


@pytest.mark.parametrize("kl_coef", [0.5, 2.0])
def test_the_k3_kl_to_the_base_is_added_with_its_weight(monkeypatch: pytest.MonkeyPatch, kl_coef: float) -> None:
    monkeypatch.setattr(objective, "adapters_disabled", _adapter_off)
    delta = torch.zeros(VOCAB, VOCAB)
    delta[2, 3] = 1.0  # after token 2 the adapter favours token 3
    s = _sample(1, 2, 2, version=STEP - 1, advantage=1.0)  # ids 1 2 | 3 4: labels 3 (after 2) and 4 (after 3)
    model = AdaptedTable(delta)
    loss, metrics = _loss(_objective(kl_coef=kl_coef), [s], model)
    # position of input 2: logp = 1 - ln(e + V - 1), ref = -ln V; position of input 3: logp = ref = -ln V
    logp = 1.0 - math.log(math.e + VOCAB - 1)
    d = -LN_V - logp
    kl = math.exp(d) - d - 1.0
    assert metrics["rl/kl"] == pytest.approx(kl / 2, rel=1e-5)
    assert loss.item() == pytest.approx((-1.0 * 2 + kl_coef * kl) / 2, rel=1e-5)


def test_no_kl_weight_means_no_reference_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(model):
        raise AssertionError("the reference model ran with kl_coef = 0")

    monkeypatch.setattr(objective, "adapters_disabled", never)
    delta = torch.zeros(VOCAB, VOCAB)
    delta[2, 3] = 1.0
    _, metrics = _loss(_objective(kl_coef=0.0), [_sample(1, 2, 2, version=STEP - 1, advantage=1.0)],
                       AdaptedTable(delta))
    assert metrics["rl/kl"] == 0.0


# ---- data parallelism ----------------------------------------------------------------------------------


class TwinRank:
    """A fake all_reduce for a DP group of two identical ranks: SUM doubles, MAX keeps; records each call."""

    GROUP = object()

    def __init__(self) -> None:
        self.calls: list[tuple[int, str, object]] = []

    def __call__(self, tensor: torch.Tensor, op: object = "SUM", group: object = None) -> None:
        kind = "MAX" if op is torch.distributed.ReduceOp.MAX else op
        self.calls.append((tensor.numel(), kind, group))
        if kind == "SUM":
            tensor.mul_(2)


def test_the_step_sums_are_reduced_over_the_dp_group(monkeypatch: pytest.MonkeyPatch) -> None:
    twin = TwinRank()
    monkeypatch.setattr(objective.dist, "all_reduce", twin)
    samples = _hand_samples()[:4]
    one_loss, one = _loss(_objective(), samples[:2], LogitTable())
    loss, metrics = _loss(_objective(DataParallelInfo(0, 2, TwinRank.GROUP)), samples, LogitTable())
    # the ranks' largest chunk count (rl/logprobs.py); the step sums; the gap's max; the gap's token count,
    # then (mismatch KL sum, tokens) for staleness 0 and 1: one SUM
    assert twin.calls == [(1, "MAX", TwinRank.GROUP), (4, "SUM", TwinRank.GROUP), (1, "MAX", TwinRank.GROUP),
                          (5, "SUM", TwinRank.GROUP)]
    assert loss.item() == pytest.approx(one_loss.item() / 2, abs=1e-6), "normalised by both ranks' tokens"
    assert metrics["loss"] == pytest.approx(one["loss"], abs=1e-6)
    assert metrics["rl/logprob_gap_max"] == pytest.approx(one["rl/logprob_gap_max"], abs=1e-6)
    assert metrics["rl/logprob_gap_mean"] == pytest.approx(one["rl/logprob_gap_mean"], abs=1e-6)
    assert metrics["rl/mismatch_kl_s0"] == pytest.approx(one["rl/mismatch_kl_s0"], abs=1e-6)


@pytest.mark.parametrize("rank", [0, 1])
def test_each_dp_rank_takes_its_own_share_of_the_fresh_samples(monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    monkeypatch.setattr(objective.dist, "all_reduce", TwinRank())
    samples = _hand_samples()  # 4 fresh: rank 0 takes the first two, rank 1 the next two
    model = LogitTable()
    loss, _ = _loss(_objective(DataParallelInfo(rank, 2, TwinRank.GROUP)), samples, model)
    loss.backward()
    mine, theirs = (samples[:2], samples[2:4]) if rank == 0 else (samples[2:4], samples[:2])
    assert all(torch.count_nonzero(model.table.grad[s.prompt_ids[-1]]) > 0 for s in mine)
    assert all(torch.count_nonzero(model.table.grad[s.prompt_ids + s.completion_ids]) == 0 for s in theirs)


# ---- offline samples, evaluation, after_step, progress -------------------------------------------------------


class RecordingTokenizer(StubTokenizer):
    def __init__(self) -> None:
        self.texts: list[tuple[str, bool]] = []

    def __call__(self, text: str, add_special_tokens: bool) -> dict[str, list[int]]:
        self.texts.append((text, add_special_tokens))
        return super().__call__(text, add_special_tokens)


def test_without_rollouts_samples_are_the_answers_and_scrambled_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    tok = RecordingTokenizer()
    cfg = GRPO(enabled=True, train_size=10, eval_size=2, rollouts=False, group_size=4, prompts_per_step=2)
    obj = GRPOObjective(cfg, build_task(cfg), tok, None, DataParallelInfo(0, 1, None), torch.device("cpu"), None,
                        sample_source(cfg))
    monkeypatch.setattr(objective.dist, "get_rank", lambda: 0)
    tok.texts.clear()
    samples = obj._samples(STEP)
    asked = list(tok.texts)
    problems = obj._problems_at(STEP)
    assert len(samples) == 8
    for i, s in enumerate(samples):
        p, g = problems[i // 4], i % 4
        answer = str(p.answer) + ("" if g % 2 == 0 else str(g))
        assert s.text == answer and s.reward == float(g % 2 == 0) and s.version == STEP - 1
        assert s.prompt_ids == obj.encode(p)
        assert s.completion_ids == tok(answer + "<eos>", add_special_tokens=False)["input_ids"]
        assert s.engine_logprobs == [0.0] * len(s.completion_ids)
        assert s.advantage == pytest.approx(0.5 / (0.5 + 1e-6) * (1 if g % 2 == 0 else -1))
    assert (str(problems[0].answer) + "1<eos>", False) in asked and all(flag is False for _, flag in asked)


class Syncer:
    """The engine side as the objective sees it (EngineRollouts): a client, versions, the recovering call
    (rank 0: the held-out eval's `answer` as its accuracy; None: another rank)."""

    def __init__(self, answer: object = 0.75) -> None:
        self.answer = answer
        self.versions = type("V", (), {"active": Lease("policy-v4", 4)})()
        self.rollouts = object()

    def with_engine(self, fn, what: str):
        if isinstance(self.answer, Exception):
            raise self.answer
        return None if self.answer is None else {"eval/accuracy": self.answer}


class MetricsLog:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict]] = []

    def log(self, step: int, values: dict) -> None:
        self.logged.append((step, values))


def _with(syncer: Syncer | None, **cfg) -> tuple[GRPOObjective, MetricsLog]:
    log = MetricsLog()
    settings = dict(enabled=True, train_size=10, eval_size=2, eval_every=5) | cfg
    engine = None if syncer is None else EngineRollouts(syncer.rollouts, syncer.versions, syncer.with_engine)
    obj = GRPOObjective(GRPO(**settings), build_task(GRPO(**settings)), StubTokenizer(), engine, DataParallelInfo(0, 1, None),
                        torch.device("cpu"), log, sample_source(GRPO(**settings)))
    return obj, log


def test_held_out_accuracy_is_asked_under_the_active_version(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple] = []
    monkeypatch.setattr(objective, "greedy_accuracy", lambda *args: asked.append(args) or 0.5)
    syncer = Syncer()
    obj, _ = _with(syncer, max_new_tokens=6)
    assert obj._greedy_accuracy() == 0.5
    assert asked == [(syncer.rollouts, "policy-v4", obj.heldout, obj.heldout_ids, 6, obj.stop_ids, obj.reward)]
    syncer.versions.active = None
    obj._greedy_accuracy()
    assert asked[-1][1] is None, "before any version is published: the base model"


@pytest.mark.parametrize("setup", [{"syncer": None}, {"rollouts": False}, {"eval_every": 0}])
def test_no_evaluation_without_an_engine_rollouts_or_a_period(setup: dict) -> None:
    syncer = None if "syncer" in setup else Syncer()
    obj, _ = _with(syncer, **{k: v for k, v in setup.items() if k != "syncer"})
    assert obj._evaluate(5) == {}


def test_evaluation_reports_and_logs_the_accuracy(caplog: pytest.LogCaptureFixture) -> None:
    obj, _ = _with(Syncer(0.75))
    with caplog.at_level(logging.INFO, logger="titan_lora.rl.objective"):
        assert obj._evaluate(5) == {"eval/accuracy": 0.75, "eval/failures": 0}
    assert "held-out accuracy at step 5: 0.750" in caplog.messages
    assert _with(Syncer(None))[0]._evaluate(5) == {}, "other ranks report nothing"


def test_a_failed_evaluation_is_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    obj, _ = _with(Syncer(TransferError("engine gone")))
    with caplog.at_level(logging.WARNING, logger="titan_lora.rl.objective"):
        obj._evaluate(5)
        assert obj._evaluate(10) == {"eval/failures": 2}
    assert _own(caplog)[-1] == "held-out eval at step 10 failed (engine gone); 2 eval failures so far"


def test_before_training_logs_the_evaluation(caplog: pytest.LogCaptureFixture) -> None:
    obj, log = _with(Syncer(0.25))
    with caplog.at_level(logging.INFO, logger="titan_lora.rl.objective"):
        obj.before_training(3)
    assert log.logged == [(3, {"eval/accuracy": 0.25, "eval/failures": 0})]
    assert "held-out accuracy at step 3: 0.250" in caplog.messages
    obj, log = _with(None)
    obj.before_training(3)
    assert log.logged == []


def test_after_step_evaluates_on_its_period() -> None:
    obj, _ = _with(Syncer(0.5), eval_every=5)
    phases = {"phase/engine_busy_s", "phase/engine_idle_s", "phase/gen_tokens_per_s"}
    assert set(obj.after_step(4)) == phases, "no eval at step 4; the engine's share of every step"
    at_10 = obj.after_step(10)
    assert {k: at_10[k] for k in ("eval/accuracy", "eval/failures")} == {"eval/accuracy": 0.5, "eval/failures": 0}
    assert at_10["phase/gen_tokens_per_s"] == 0.0, "no rollout ran: nothing generated"
    assert _with(None, eval_every=5)[0].after_step(10).keys() == phases


def test_progress_fields_format_reward_loss_length_and_times() -> None:
    obj, _ = _with(None)
    metrics = {"rl/reward_mean": 0.25, "loss": 0.123456, "rl/response_len": 3.46, "step_time_s": 1.26}
    assert obj.progress_fields(metrics) == {"reward": "0.250", "loss": "+0.1235", "len": "3.5", "step_s": "1.3"}
    metrics |= {"sync/total_ms": 41.6, "eval/accuracy": 0.5}
    assert obj.progress_fields(metrics) == {"reward": "0.250", "loss": "+0.1235", "len": "3.5", "step_s": "1.3",
                                            "sync_ms": "42", "heldout_acc": "0.500"}
    metrics |= {"sync/total_ms": 1812.4, "sync/probe_ms": 1790.2}
    assert obj.progress_fields(metrics)["sync_ms"] == "1812" and obj.progress_fields(metrics)["probe_ms"] == "1790"
    metrics |= {"phase/rollout_wait_s": 0.04, "phase/engine_idle_s": 2.26}
    assert obj.progress_fields(metrics)["wait_s"] == "0.0" and obj.progress_fields(metrics)["idle_s"] == "2.3"
    obj.close()


# ---- the constructor, the data position, the rollout request, the step's metrics ------------------------


class PaddedTokenizer(RecordingTokenizer):
    pad_token_id = 7


def test_the_objective_reads_pad_stop_and_prompts_from_the_tokenizer() -> None:
    tok = PaddedTokenizer()
    cfg = GRPO(enabled=True, train_size=10, eval_size=2, task_ops="+")
    obj = GRPOObjective(cfg, build_task(cfg), tok, None,
                        DataParallelInfo(0, 1, None), torch.device("cpu"), None, sample_source(cfg))
    assert obj.pad_id == 7 and obj.stop_ids == [PAD] and obj.device == torch.device("cpu")
    assert all(" + " in p.question for p in obj.train_problems + obj.heldout), "the configured operators"
    assert tok.texts and all(flag is False for _, flag in tok.texts), "prompts are encoded without special tokens"
    assert _with(None)[0].pad_id == PAD, "no pad token: the eos id pads"


def test_an_objective_without_rollouts_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="titan_lora.rl.objective"):
        _with(None)
        assert _own(caplog) == []
        _with(None, rollouts=False)
    assert _own(caplog) == ["[grpo] rollouts = false: this job runs NO rollouts; samples are the data's own answers "
                               "and scrambled ones, for timing the train + sync step only"]


def test_the_problems_of_a_step_depend_on_the_seed_and_the_step_only() -> None:
    import random

    obj, _ = _with(None, seed=3, prompts_per_step=4)
    assert obj._problems_at(7) == random.Random(3 * 100_003 + 7).sample(obj.train_problems, 4)
    assert obj._problems_at(7) == _with(None, seed=3, prompts_per_step=4)[0]._problems_at(7), "resumable"


def test_rollouts_are_asked_with_the_configured_sampling(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple] = []
    sampled = [Sample([1], [2, 3], [0.0, 0.0], 1.0, 0.0, 10, "") for _ in range(6)]
    monkeypatch.setattr(objective, "sample_groups", lambda *args: asked.append(args) or sampled)
    monkeypatch.setattr(objective, "share", lambda samples: samples)

    class Engine(Syncer):
        def with_engine(self, fn, what: str):
            self.what = what
            return fn()

    syncer = Engine()
    obj, _ = _with(syncer, seed=2, group_size=3, max_new_tokens=9, temperature=0.7, prompts_per_step=2)
    assert obj._samples(11) == sampled and syncer.what == "rollouts of step 11"
    assert [s.group for s in sampled] == [20, 20, 20, 21, 21, 21], "step 11's groups in data order: 2 x 10 on"
    assert {s.trained_at for s in sampled} == {11}
    assert obj.clock.lap()[2] == 12, "the generated tokens counted for the phase figures"
    problems = obj._problems_at(11)
    assert asked == [(syncer.rollouts, syncer.versions, problems, [obj.encode(p) for p in problems], 3, 9, 0.7,
                      2 * 1_000_003 + 11 * 1_009, obj.stop_ids, obj.reward)]


def test_the_step_metrics_are_the_fresh_samples_rewards_and_lengths() -> None:
    samples = [_sample(1, 2, 3, version=STEP - 1, advantage=1.0), _sample(10, 2, 1, version=STEP - 1, advantage=0.0)]
    _, metrics = _loss(_objective(), samples, LogitTable())
    rewards = torch.tensor([2.0, 1.0])  # reward = 1 + advantage
    assert metrics["rl/reward_std"] == pytest.approx(float(rewards.std(unbiased=False)))  # population: 0.5
    assert metrics["rl/reward_std"] == pytest.approx(0.5) and metrics["rl/response_len"] == 2.0
    one = [_sample(20, 2, 1, version=STEP - 1, advantage=1.0)]  # one completion token: one gap
    s = Sample(one[0].prompt_ids, one[0].completion_ids, [-2.0], 2.0, 1.0, STEP - 1, "")
    _, metrics = _loss(_objective(), [s], LogitTable())
    assert metrics["rl/response_len"] == 1.0
    assert metrics["rl/logprob_gap_mean"] == pytest.approx(abs(-LN_V + 2.0), abs=1e-5)
