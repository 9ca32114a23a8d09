"""The arithmetic task: seeded prompts, a held-out split, and the exact-match answer parser."""

from __future__ import annotations

import dataclasses
import random
import re

from titan_lora.model.chat import chat_prompt

INSTRUCTION = "Answer with just the number."
_LAST_INT = re.compile(r"-?\d+")


@dataclasses.dataclass(frozen=True)
class Problem:
    """One arithmetic question and its answer."""

    question: str
    answer: int


def make_problems(n: int, seed: int, max_digits: int = 1, ops: str = "+-") -> list[Problem]:
    """`n` seeded problems `a op b` with operands of 1..max_digits digits."""
    rng = random.Random(seed)
    hi = 10**max_digits - 1
    out = []
    for _ in range(n):
        a, b, op = rng.randint(0, hi), rng.randint(0, hi), rng.choice(ops)
        out.append(Problem(f"What is {a} {op} {b}?", a + b if op == "+" else a - b))
    return out


def train_and_heldout(n_train: int, n_heldout: int, seed: int, max_digits: int = 1, ops: str = "+-"):  # noqa: ANN201
    """Disjoint train and held-out problem lists (held-out questions never appear in train)."""
    heldout = make_problems(n_heldout, seed + 1_000_000, max_digits, ops)
    held_q = {p.question for p in heldout}
    pool = [p for p in make_problems(n_train * 3, seed, max_digits, ops) if p.question not in held_q]
    if len(pool) < n_train:
        raise ValueError(f"only {len(pool)} distinct training problems for {max_digits} digit(s); lower the count")
    return pool[:n_train], heldout


def arith_prompt(tokenizer, question: str) -> str:  # noqa: ANN001
    """The question and the answer-format instruction, in the model's chat template."""
    return chat_prompt(tokenizer, f"{question} {INSTRUCTION}")


def parse_answer(text: str) -> int | None:
    """The last integer in a completion, or None."""
    found = _LAST_INT.findall(text)
    return int(found[-1]) if found else None


def exact_match(completion: str, problem: Problem) -> float:
    """1.0 when the completion's last integer equals the answer, else 0.0."""
    return 1.0 if parse_answer(completion) == problem.answer else 0.0
