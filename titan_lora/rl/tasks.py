"""The arithmetic task (`[grpo] task = "arith"`): seeded `a op b` questions and the exact-match reward."""

from __future__ import annotations

import dataclasses
import random

from titan_lora.config import GRPO
from titan_lora.rl.extract import is_correct
from titan_lora.rl.task import Problem

INSTRUCTION = "Answer with just the number."


def make_problems(n: int, seed: int, max_digits: int = 1, ops: str = "+-") -> list[Problem]:
    """`n` seeded problems `a op b` with operands of 1..max_digits digits."""
    rng = random.Random(seed)
    hi = 10**max_digits - 1
    out = []
    for _ in range(n):
        a, b, op = rng.randint(0, hi), rng.randint(0, hi), rng.choice(ops)
        out.append(Problem(f"What is {a} {op} {b}?", a + b if op == "+" else a - b))
    return out


def exact_match(completion: str, problem: Problem) -> float:
    """1.0 when the completion's last number equals the answer (an int, or a string such as a JSONL
    task's "42"), else 0.0."""
    return float(is_correct("last_number", completion, str(problem.answer)))


@dataclasses.dataclass(frozen=True)
class ArithTask:
    """Addition and subtraction of operands with up to `max_digits` digits, answered as an integer."""

    max_digits: int = 1
    ops: str = "+-"
    instruction: str = INSTRUCTION

    def problems(self, n: int, seed: int) -> list[Problem]:
        """`n` seeded problems."""
        return make_problems(n, seed, self.max_digits, self.ops)

    def reward(self, completion: str, problem: Problem) -> float:
        """Exact match of the completion's last integer."""
        return exact_match(completion, problem)


def arith_task(cfg: GRPO) -> ArithTask:
    """The task from `[grpo] task_digits` and `task_ops`."""
    return ArithTask(cfg.task_digits, cfg.task_ops)
