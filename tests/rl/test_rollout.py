"""Reward evaluation in the rollout path: a reward that fails on one sample scores that sample 0, is
counted in the step's `rl/reward_errors` and logged once with the sample, and never ends the run. Through
the real `sample_groups` and `greedy_accuracy` with a scripted RolloutClient, and the real GRPO loss."""

from __future__ import annotations

import logging

import pytest
from test_grpo_objective import STEP, LogitTable, _loss, _objective

from titan_lora.clients.rollout import Completion
from titan_lora.rl.jsonl import JsonlTask
from titan_lora.rl.rollout import greedy_accuracy, sample_groups
from titan_lora.rl.task import Problem
from titan_lora.sync.versions import AdapterVersions

PROBLEMS = [Problem("What is 1 + 1?", 2), Problem("What is 2 + 3?", 5)]
PROMPTS = [[1, 2, 3], [4, 5, 6]]
GROUP = 4


class ScriptedClient:
    """Answers the i-th prompt of a request with `texts[i]`; one token per reply, ids below VOCAB."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts

    def generate(self, prompts, adapter, max_tokens, temperature, seed, stop):
        assert len(prompts) == len(self.texts)
        return [Completion([10 + i], t, [-1.0]) for i, t in enumerate(self.texts)]

    def score(self, sequences, adapter):
        raise NotImplementedError


def integer_reward(completion: str, problem: Problem) -> float:
    """A user's plug-in with a bug: it assumes the reply is an integer (`int("two")` raises)."""
    return float(int(completion.strip()) == int(problem.answer))


def _versions() -> AdapterVersions:
    versions = AdapterVersions("policy", 2)
    versions.publish(STEP - 1)  # the version the engine serves during step STEP
    return versions


def _records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "titan_lora.rl.rollout"]


def test_a_reward_that_raises_on_one_sample_scores_it_0_and_the_run_goes_on(
        caplog: pytest.LogCaptureFixture) -> None:
    texts = ["2", "3", "two", "2", "5", "4", "4", "5"]  # sample 2: the plug-in raises ValueError
    with caplog.at_level(logging.WARNING, logger="titan_lora.rl.rollout"):
        samples = sample_groups(ScriptedClient(texts), _versions(), PROBLEMS, PROMPTS, GROUP, max_tokens=4,
                                temperature=1.0, seed=0, stop_token_ids=[], reward=integer_reward)
    # Hand-derived: both groups score [1, 0, 0, 1]; mean 0.5, std 0.5, so advantages +-1 (eps 1e-6).
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert [s.advantage for s in samples] == pytest.approx([1, -1, -1, 1, 1, -1, -1, 1], abs=1e-5)
    assert [s.reward_error for s in samples] == [False, False, True, False, False, False, False, False]
    [record] = _records(caplog)  # one line, for the one sample
    assert record.levelno == logging.WARNING and record.exc_info, "with the plug-in's traceback"
    assert record.getMessage() == (
        "rollouts under policy-v4: the reward failed on sample 2 of 8 (question 'What is 1 + 1?', completion "
        "'two') with ValueError: invalid literal for int() with base 10: 'two'; it scores 0")
    _, metrics = _loss(_objective(), samples, LogitTable())
    assert metrics["rl/reward_errors"] == 1 and metrics["rl/samples"] == 8
    assert metrics["rl/reward_mean"] == 0.5


def test_a_reward_that_is_no_finite_number_is_a_reward_error(caplog: pytest.LogCaptureFixture) -> None:
    values = iter([1.0, float("nan"), 0.0, 0.0, None, 1.0, 1.0, 0.0])  # float(None) raises TypeError
    with caplog.at_level(logging.WARNING, logger="titan_lora.rl.rollout"):
        samples = sample_groups(ScriptedClient(["x"] * 8), _versions(), PROBLEMS, PROMPTS, GROUP, 4, 1.0, 0,
                                [], reward=lambda completion, problem: next(values))
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    assert [i for i, s in enumerate(samples) if s.reward_error] == [1, 4]
    messages = [r.getMessage() for r in _records(caplog)]
    assert [m.split(" with ")[1] for m in messages] == [
        "ValueError: the reward returned nan, not a finite number; it scores 0",
        "TypeError: float() argument must be a string or a real number, not 'NoneType'; it scores 0"]
    assert [bool(r.exc_info) for r in _records(caplog)] == [True, False], "one traceback per batch"
    _, metrics = _loss(_objective(), samples, LogitTable())
    assert metrics["rl/reward_errors"] == 2


def test_a_boxed_snan_reply_scores_0_and_ends_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """The issue's reply: `\\boxed{sNaN}` made the boxed reward raise InvalidOperation, ending the run."""
    task = JsonlTask(tuple(PROBLEMS), (), "boxed")
    texts = [r"\boxed{2}", r"\boxed{sNaN}", r"\boxed{NaN}", r"\boxed{Infinity}"] + [r"\boxed{5}"] * 4
    with caplog.at_level(logging.WARNING, logger="titan_lora.rl.rollout"):
        samples = sample_groups(ScriptedClient(texts), _versions(), PROBLEMS, PROMPTS, GROUP, 4, 1.0, 0, [],
                                reward=task.reward)
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert not any(s.reward_error for s in samples) and _records(caplog) == [], "a wrong answer, not an error"


def test_held_out_accuracy_scores_a_failing_reward_0(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="titan_lora.rl.rollout"):
        accuracy = greedy_accuracy(ScriptedClient(["2", "five"]), None, PROBLEMS, PROMPTS, 4, [],
                                   integer_reward)
    assert accuracy == 0.5
    [record] = _records(caplog)
    assert record.getMessage().startswith(
        "held-out eval under the base model: the reward failed on sample 1 of 2 (question 'What is 2 + 3?', "
        "completion 'five') with ValueError")


def test_a_long_completion_is_cut_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    long = "9" * 1000 + "x"  # the plug-in's error repeats it too
    with caplog.at_level(logging.WARNING, logger="titan_lora.rl.rollout"):
        greedy_accuracy(ScriptedClient([long, "5"]), "policy-v1", PROBLEMS, PROMPTS, 4, [], integer_reward)
    [record] = _records(caplog)
    assert f"completion '{'9' * 300}...')" in record.getMessage() and len(record.getMessage()) < 800
