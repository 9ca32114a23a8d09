"""GRPO tasks: the protocol, the registry (`[grpo] task`) and what every task shares.

A task gives seeded problems, an instruction that fixes the answer's format, and a reward. The prompt
is the question and the instruction in the model's chat template, for every task alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

from titan_lora.config import GRPO
from titan_lora.models.chat import chat_prompt
from titan_lora.registry import Registry


@dataclasses.dataclass(frozen=True)
class Problem:
    """One question and its answer."""

    question: str
    answer: int | str


class Task(Protocol):
    """What the GRPO loop needs from a task."""

    instruction: str
    """Appended to every question; says how to format the answer (the reward relies on it)."""

    def problems(self, n: int, seed: int) -> list[Problem]:
        """`n` problems, the same for the same seed."""
        ...

    def reward(self, completion: str, problem: Problem) -> float:
        """The reward of one completion (1.0 for a right answer, by convention)."""
        ...


TaskFactory = Callable[[GRPO], Task]
_TASKS: Registry[TaskFactory] = Registry("[grpo] task", "task", {
    "arith": "titan_lora.rl.tasks:arith_task",
    "reverse": "titan_lora.rl.reverse:reverse_task",
})


def register_task(name: str, factory: TaskFactory) -> None:
    """Make `factory([grpo] section) -> Task` available as `[grpo] task = name`."""
    _TASKS.register(name, factory)


def build_task(cfg: GRPO) -> Task:
    """The task `[grpo] task` names (a registered name or `package.module:factory`), built from `cfg`."""
    return _TASKS.get(cfg.task)(cfg)


def task_prompt(tokenizer, task: Task, question: str) -> str:  # noqa: ANN001
    """The question and the task's instruction, in the model's chat template."""
    return chat_prompt(tokenizer, f"{question} {task.instruction}")


def train_and_heldout(task: Task, n_train: int, n_heldout: int, seed: int) -> tuple[list[Problem], list[Problem]]:
    """Disjoint train and held-out problem lists (held-out questions never appear in train)."""
    heldout = task.problems(n_heldout, seed + 1_000_000)
    held_q = {p.question for p in heldout}
    pool = [p for p in task.problems(n_train * 3, seed) if p.question not in held_q]
    if len(pool) < n_train:
        raise ValueError(f"the task has only {len(pool)} training problems outside the held-out set for "
                         f"[grpo] train_size = {n_train}; lower train_size or widen the task (e.g. task_digits)")
    return pool[:n_train], heldout
