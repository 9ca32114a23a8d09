"""Word problems (`[grpo] task = "word_problems"`): seeded short stories of a few gains and losses.

Harder than 1-digit arithmetic: the model must read which steps add and which subtract, and carry a
running total. `[task] steps` and `max_number` set the difficulty.
"""

from __future__ import annotations

import dataclasses
import random

from titan_lora.config import GRPO
from titan_lora.rl.task import Problem
from titan_lora.rl.tasks import exact_match

NAMES = ("Sam", "Mia", "Leo", "Ava", "Ben", "Zoe", "Max", "Ivy")
ITEMS = ("apples", "marbles", "stickers", "books", "pencils", "coins", "cards", "shells")
GAINS = ("buys {n} more", "finds {n} more", "gets {n} more")
LOSSES = ("gives away {n}", "loses {n}", "sells {n}")


@dataclasses.dataclass(frozen=True)
class WordProblemsTask:
    """A count of 2..max_number, then `steps` gains or losses of 1..max_number each; the answer is the final
    count."""

    steps: int = 2
    max_number: int = 9
    instruction: str = "Answer with just the number."

    def problem(self, rng: random.Random) -> Problem:
        """One seeded story, starting from 2 or more; a loss never takes the count below zero."""
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        count = rng.randint(2, self.max_number)
        sentences = [f"{name} has {count} {item}."]
        for _ in range(self.steps):
            n = rng.randint(1, self.max_number)
            if rng.random() < 0.5 and count >= 1:
                n = min(n, count)
                count -= n
                phrase = rng.choice(LOSSES)
            else:
                count += n
                phrase = rng.choice(GAINS)
            sentences.append(f"Then {name} {phrase.format(n=n)}.")
        sentences.append(f"How many {item} does {name} have now?")
        return Problem(" ".join(sentences), count)

    def problems(self, n: int, seed: int) -> list[Problem]:
        """`n` seeded stories."""
        rng = random.Random(seed)
        return [self.problem(rng) for _ in range(n)]

    def reward(self, completion: str, problem: Problem) -> float:
        """1.0 when the completion's last number is the final count."""
        return exact_match(completion, problem)


def word_problems_task(cfg: GRPO, *, steps: int = 2, max_number: int = 9) -> WordProblemsTask:
    """The task from `[task] steps` (>= 1) and `max_number` (>= 2: a story starts from 2..max_number)."""
    for key, value, least in (("steps", steps, 1), ("max_number", max_number, 2)):
        if value < least:
            raise ValueError(f"[task] {key} = {value}: use an integer >= {least} "
                             "(defaults: steps = 2, max_number = 9)")
    return WordProblemsTask(steps, max_number)
