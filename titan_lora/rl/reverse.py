"""The reversal task (`[grpo] task = "reverse"`): spell a seeded four-letter word backwards.

A second task beside arithmetic, with a text answer: what a task plug-in takes is this one file.
"""

from __future__ import annotations

import dataclasses
import random
import string

from titan_lora.config import GRPO
from titan_lora.rl.task import Problem

WORD_LEN = 4


@dataclasses.dataclass(frozen=True)
class ReverseTask:
    """Reverse a random lowercase word; the reward is an exact match of the completion's last word."""

    instruction: str = "Answer with just the reversed word."

    def problems(self, n: int, seed: int) -> list[Problem]:
        """`n` seeded words with their reversals."""
        rng = random.Random(seed)
        words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(WORD_LEN)) for _ in range(n)]
        return [Problem(f"Spell '{w}' backwards.", w[::-1]) for w in words]

    def reward(self, completion: str, problem: Problem) -> float:
        """1.0 when the last word of the completion, stripped of quotes and punctuation, is the answer."""
        words = completion.strip().split()
        return float(bool(words) and words[-1].strip(string.punctuation).lower() == problem.answer)


def reverse_task(cfg: GRPO) -> ReverseTask:
    """The task; it takes no options from `[grpo]`."""
    return ReverseTask()
