"""GRPO tasks: the protocol, the registry (`[grpo] task`) and what every task shares.

A task gives seeded problems, an instruction that fixes the answer's format, and a reward. The prompt
is the question and the instruction in the model's chat template, for every task alike. A task's
factory takes the `[grpo]` section and the `[task]` section as keyword arguments: its signature is
the schema of `[task]`, checked here (unknown, missing and mistyped keys) before the factory runs.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import types
import typing
from collections.abc import Callable
from typing import Any, Protocol

from titan_lora.config import GRPO
from titan_lora.models.chat import chat_prompt
from titan_lora.registry import Registry


@dataclasses.dataclass(frozen=True)
class Problem:
    """One question and its answer, with the system message it is asked under (empty: none)."""

    question: str
    answer: int | str
    system: str = ""


class Task(Protocol):
    """What the GRPO loop needs from a task.

    A task over a fixed dataset also defines `split(n_train, n_heldout, seed) -> (train, heldout)`;
    generated tasks get the default split of `train_and_heldout`.
    """

    instruction: str
    """Appended to every question; says how to format the answer (the reward relies on it)."""

    def problems(self, n: int, seed: int) -> list[Problem]:
        """`n` problems, the same for the same seed."""
        ...

    def reward(self, completion: str, problem: Problem) -> float:
        """The reward of one completion (1.0 for a right answer, by convention)."""
        ...


TaskFactory = Callable[..., Task]
"""`factory(grpo_section, **task_section) -> Task` (or an `agent_task.AgentTask`)."""
_TASKS: Registry[TaskFactory] = Registry("[grpo] task", "task", {
    "arith": "titan_lora.rl.tasks:arith_task",
    "reverse": "titan_lora.rl.reverse:reverse_task",
    "jsonl": "titan_lora.rl.jsonl:jsonl_task",
    "word_problems": "titan_lora.rl.word:word_problems_task",
    "calculator_agent": "titan_lora.rl.calculator_agent:calculator_agent_task",
})


def register_task(name: str, factory: TaskFactory) -> None:
    """Make `factory([grpo] section, **[task] section) -> Task` available as `[grpo] task = name`."""
    _TASKS.register(name, factory)


def _fits(value: object, hint: object) -> bool:
    """Whether a TOML value fits a factory's annotation (int where float is asked; bool is no number)."""
    if hint is Any or hint is inspect.Parameter.empty:
        return True
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint in (int, float) and isinstance(value, bool):
        return False
    if hint is float:
        return isinstance(value, (int, float))
    origin = typing.get_origin(hint) or hint
    return not isinstance(origin, type) or isinstance(value, origin)


def task_options(factory: TaskFactory, name: str, options: dict[str, Any]) -> dict[str, Any]:
    """`options` (the `[task]` section), checked against the keyword parameters of `factory`."""
    where = f"[grpo] task = {name!r}"
    params = {p.name: p for p in list(inspect.signature(factory).parameters.values())[1:]
              if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    for key in options:
        if key in params:
            continue
        if not params:
            raise ValueError(f"[task] {key} is set, but {where} takes no [task] keys; "
                             "remove the [task] section")
        close = difflib.get_close_matches(key, params, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"it takes {', '.join(sorted(params))}"
        raise ValueError(f"[task] has an unknown key {key!r} for {where}; {hint}")
    hints = typing.get_type_hints(factory) if params else {}
    for key, p in params.items():
        if key not in options:
            if p.default is p.empty:
                raise ValueError(f"[task] {key} is required by {where}; "
                                 f"add `{key} = ...` to the [task] section")
            continue
        hint = hints.get(key, p.empty)
        if not _fits(options[key], hint):
            raise ValueError(f"[task] {key} = {options[key]!r} must be of type "
                             f"{getattr(hint, '__name__', hint)} for {where}")
    return options


def build_task(cfg: GRPO, options: dict[str, Any] | None = None) -> Task:
    """The task `[grpo] task` names (a registered name or `package.module:factory`), built from `cfg` and
    `options` (the `[task]` section, validated by the task before any model is built)."""
    factory = _TASKS.get(cfg.task)
    options = task_options(factory, cfg.task, options or {})
    where = f"[grpo] task = {cfg.task!r}"
    try:
        inspect.signature(factory).bind(cfg, **options)
    except TypeError as err:
        raise ValueError(f"{where}: its factory cannot be called as factory([grpo] section, **[task] section) "
                         f"({err}); give it that signature") from None
    try:
        return factory(cfg, **options)
    except ValueError:  # the task's own one-line refusal of its options
        raise
    except Exception as err:  # a plug-in's bug: one line naming the task (the traceback stays in __cause__)
        raise ValueError(f"{where}: its factory raised {type(err).__name__}: {err}") from err


def task_prompt(tokenizer, task: Task, question: str, system: str = "") -> str:  # noqa: ANN001
    """The question and the task's instruction (and `system`, when given), in the model's chat template."""
    instruction = getattr(task, "instruction", "")  # an agent task has none: its episodes write their own prompts
    return chat_prompt(tokenizer, f"{question} {instruction}" if instruction else question, system)


def train_and_heldout(task: Task, n_train: int, n_heldout: int, seed: int) -> tuple[list[Problem], list[Problem]]:
    """Disjoint train and held-out problem lists (held-out questions never appear in train)."""
    split = getattr(task, "split", None)
    if split is not None:  # a fixed dataset splits itself (a held-out file or fraction)
        return split(n_train, n_heldout, seed)
    heldout = task.problems(n_heldout, seed + 1_000_000)
    held_q = {p.question for p in heldout}
    pool = [p for p in task.problems(n_train * 3, seed) if p.question not in held_q]
    if len(pool) < n_train:
        raise ValueError(f"the task has only {len(pool)} training problems outside the held-out set for "
                         f"[grpo] train_size = {n_train}; lower train_size or widen the task (e.g. task_digits)")
    return pool[:n_train], heldout
