"""The held-out eval's agent metrics, counted on hand-made calculator episodes: the tool-call rate, the
share of answers that copy the tool's result, and their means over the episodes that report them."""

from __future__ import annotations

import pytest

from titan_lora.rl.agent_task import EpisodeResult
from titan_lora.rl.agentic import Episode
from titan_lora.rl.calculator_agent import episode_stats
from titan_lora.rl.episode_rollouts import Outcome, heldout_metrics
from titan_lora.rl.episode_samples import EpisodeCounts, sum_counts
from titan_lora.rl.task import Problem
from titan_lora.transfer.episodes import EpisodeRecord

PROBLEM = Problem("What is 123 * 456?", 56088)


def episode(replies: list[str], call: str | None = None, result: str | None = None,
            reward: float = 0.0) -> Episode:
    return Episode(PROBLEM, replies, call, result, reward, "policy-v0", 0)


NO_TOOL = episode(["56000"])  # answered unaided, wrong
COPIED = episode(["CALC: 123 * 456", "The answer is 56,088"], "123 * 456", "56088", 1.0)
MISREAD = episode(["CALC: 123 * 456", "56008"], "123 * 456", "56088")
WRONG_CALL = episode(["CALC: 123 + 456", "579"], "123 + 456", "579")  # copied, but called with the wrong sum
TOOL_ERROR = episode(["CALC: 123 * x", "56088"], "123 * x", "error: unknown name x", 1.0)


def test_each_episode_reports_whether_it_called_the_tool_and_whether_its_answer_copies_the_result() -> None:
    assert episode_stats(NO_TOOL) == {"tool_call_rate": 0.0}
    assert episode_stats(COPIED) == {"tool_call_rate": 1.0, "tool_copy_share": 1.0}
    assert episode_stats(MISREAD) == {"tool_call_rate": 1.0, "tool_copy_share": 0.0}
    assert episode_stats(WRONG_CALL) == {"tool_call_rate": 1.0, "tool_copy_share": 1.0}
    assert episode_stats(TOOL_ERROR) == {"tool_call_rate": 1.0}, "no result to copy: not counted"


def test_the_eval_averages_each_stat_over_the_episodes_that_report_it() -> None:
    empty = EpisodeRecord("e", None, None, (), ())
    outcomes = [Outcome(empty, e.reward, False, episode_stats(e))
                for e in (NO_TOOL, COPIED, MISREAD, WRONG_CALL, TOOL_ERROR)]
    outcomes.append(Outcome(empty, 0.0, True))  # an agent that raised: no stats, counts in accuracy only
    metrics = heldout_metrics(outcomes)
    assert metrics == {"eval/accuracy": pytest.approx(2 / 6), "eval/tool_call_rate": pytest.approx(4 / 5),
                       "eval/tool_copy_share": pytest.approx(2 / 3)}
    assert heldout_metrics([Outcome(empty, 1.0, False)]) == {"eval/accuracy": 1.0}, "a bare reward: no stats"
    assert EpisodeResult(0.5).stats == {}


def test_a_steps_episode_counts_are_the_sum_of_its_groups() -> None:
    total = sum_counts([EpisodeCounts(2, 3, 1, 0, 4, 1, 1.0), EpisodeCounts(2, 2, 0, 1, 0, 0, 0.5)])
    assert total == EpisodeCounts(4, 5, 1, 1, 4, 1, 1.5)
    assert sum_counts([]) == EpisodeCounts()
