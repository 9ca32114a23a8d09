"""The reversal task: seeded four-letter words, their reversals, and the last-word reward."""

from __future__ import annotations

import re

import pytest

from titan_lora.rl.reverse import ReverseTask
from titan_lora.rl.task import Problem


def test_problems_are_seeded_words_with_their_reversals() -> None:
    task = ReverseTask()
    problems = task.problems(20, seed=7)
    assert problems == task.problems(20, seed=7) and problems != task.problems(20, seed=8)
    for p in problems:
        word = re.fullmatch(r"Spell '([a-z]{4})' backwards\.", p.question).group(1)
        assert p.answer == word[::-1]


@pytest.mark.parametrize(("completion", "reward"), [
    ("olleh", 1.0), ("The reversed word is: OLLEH.", 1.0), ("'olleh'", 1.0), ("hello", 0.0), ("olleh x", 0.0),
    ("", 0.0), ("   ", 0.0),
])
def test_the_reward_is_an_exact_match_of_the_last_word(completion: str, reward: float) -> None:
    assert ReverseTask().reward(completion, Problem("Spell 'hello' backwards.", "olleh")) == reward
