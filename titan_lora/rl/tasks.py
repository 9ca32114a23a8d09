"""The arithmetic task (`[grpo] task = "arith"`): seeded `a op b` questions and the exact-match reward."""

from __future__ import annotations

import dataclasses
import operator
import random

from titan_lora.config import GRPO
from titan_lora.rl.extract import is_correct
from titan_lora.rl.task import Problem

INSTRUCTION = "Answer with just the number."
OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
"""The operators `[grpo] task_ops` may name, and how each answer is computed."""


def check_ops(ops: str) -> None:
    """Refuse a `[grpo] task_ops` that is empty or names an operator arith does not compute."""
    unknown = sorted(set(ops) - set(OPERATORS))
    if unknown or not ops:
        what = f"{', '.join(map(repr, unknown))} is not an operator arith computes" if unknown else "is empty"
        raise ValueError(f"[grpo] task_ops = {ops!r}: {what}; use any of {''.join(OPERATORS)!r}")


def make_problems(n: int, seed: int, max_digits: int = 1, ops: str = "+-") -> list[Problem]:
    """`n` seeded problems `a op b` with operands of 1..max_digits digits."""
    check_ops(ops)
    rng = random.Random(seed)
    hi = 10**max_digits - 1
    out = []
    for _ in range(n):
        a, b, op = rng.randint(0, hi), rng.randint(0, hi), rng.choice(ops)
        out.append(Problem(f"What is {a} {op} {b}?", OPERATORS[op](a, b)))
    return out


def exact_match(completion: str, problem: Problem) -> float:
    """1.0 when the completion's last number equals the answer (an int, or a string such as a JSONL
    task's "42"), else 0.0."""
    return float(is_correct("last_number", completion, str(problem.answer)))


@dataclasses.dataclass(frozen=True)
class ArithTask:
    """Addition, subtraction and multiplication (`ops`) of operands with up to `max_digits` digits, answered
    as an integer."""

    max_digits: int = 1
    ops: str = "+-"
    instruction: str = INSTRUCTION

    def __post_init__(self) -> None:
        check_ops(self.ops)  # refused when the task is built: before any model or engine

    def problems(self, n: int, seed: int) -> list[Problem]:
        """`n` seeded problems."""
        return make_problems(n, seed, self.max_digits, self.ops)

    def reward(self, completion: str, problem: Problem) -> float:
        """Exact match of the completion's last integer."""
        return exact_match(completion, problem)


def arith_task(cfg: GRPO) -> ArithTask:
    """The task from `[grpo] task_digits` and `task_ops`."""
    return ArithTask(cfg.task_digits, cfg.task_ops)
