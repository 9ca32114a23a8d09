"""The task registry (`[grpo] task`): built-in tasks from their section, plug-ins by name or path, the
shared prompt and the disjoint train / held-out split."""

from __future__ import annotations

import sys
import types

import pytest

from titan_lora.config import GRPO
from titan_lora.rl import task as task_mod
from titan_lora.rl.reverse import ReverseTask
from titan_lora.rl.task import Problem, build_task, register_task, task_prompt, train_and_heldout
from titan_lora.rl.tasks import ArithTask, make_problems


class EchoTask:
    """A plug-in task: the answer is the question's number."""

    instruction = "Repeat the number."

    def problems(self, n: int, seed: int) -> list[Problem]:
        return [Problem(f"Say {seed + i}.", seed + i) for i in range(n)]

    def reward(self, completion: str, problem: Problem) -> float:
        return float(completion.strip() == str(problem.answer))


def test_the_built_in_tasks_are_built_from_the_grpo_section() -> None:
    assert build_task(GRPO()) == ArithTask(1, "+-")
    assert build_task(GRPO(task_digits=3, task_ops="-")) == ArithTask(3, "-")
    assert build_task(GRPO(task="reverse")) == ReverseTask()


def test_a_registered_task_and_a_task_by_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(task_mod._TASKS, "_entries", dict(task_mod._TASKS._entries))
    register_task("echo", lambda cfg: EchoTask())
    assert isinstance(build_task(GRPO(task="echo")), EchoTask)
    module = types.ModuleType("my_tasks")
    module.echo = lambda cfg: EchoTask()
    monkeypatch.setitem(sys.modules, "my_tasks", module)
    assert build_task(GRPO(task="my_tasks:echo")).problems(2, 5) == [Problem("Say 5.", 5), Problem("Say 6.", 6)]
    with pytest.raises(ValueError) as err:
        register_task("arith", lambda cfg: EchoTask())
    assert str(err.value) == "task 'arith' is already registered"


def test_an_unknown_task_names_the_known_ones() -> None:
    with pytest.raises(ValueError) as err:
        build_task(GRPO(task="arithmetic"))
    assert str(err.value) == ("[grpo] task = 'arithmetic' is not registered; known: arith, calculator_agent, "
                              "jsonl, reverse, word_problems (or `package.module:attribute` for a plug-in)")


class ChatTokenizer:
    def apply_chat_template(self, messages: list, tokenize: bool, add_generation_prompt: bool) -> str:
        return f"<user>{messages[0]['content']}<assistant>"


def test_the_prompt_is_the_question_and_the_tasks_instruction_in_the_chat_template() -> None:
    assert task_prompt(ChatTokenizer(), EchoTask(), "Say 3.") == "<user>Say 3. Repeat the number.<assistant>"
    assert task_prompt(ChatTokenizer(), ArithTask(), "What is 1 + 2?") == (
        "<user>What is 1 + 2? Answer with just the number.<assistant>")


def test_train_and_heldout_are_disjoint_and_seeded_for_any_task() -> None:
    for task in (ArithTask(max_digits=2), ReverseTask()):
        train, held = train_and_heldout(task, 50, 20, seed=1)
        assert len(train) == 50 and len(held) == 20
        assert not {p.question for p in train} & {p.question for p in held}
        assert (train, held) == train_and_heldout(task, 50, 20, seed=1)
    one_question = types.SimpleNamespace(problems=lambda n, seed: [Problem("Say 1.", 1)] * n)
    with pytest.raises(ValueError) as err:  # the held-out set takes the only question there is
        train_and_heldout(one_question, 5, 2, seed=0)
    assert str(err.value) == ("the task has only 0 training problems outside the held-out set for [grpo] "
                              "train_size = 5; lower train_size or widen the task (e.g. task_digits)")


def test_a_plug_in_factorys_keywords_are_the_schema_of_its_task_section(monkeypatch: pytest.MonkeyPatch) -> None:
    def counting(cfg: GRPO, *, start: int, step: float = 1.0, ops: list[str] | None = None) -> EchoTask:
        made.append((start, step, ops))
        return EchoTask()

    made: list[tuple] = []
    monkeypatch.setitem(sys.modules, "my_counting", types.SimpleNamespace(make=counting))
    cfg = GRPO(task="my_counting:make")
    build_task(cfg, {"start": 3, "step": 2, "ops": ["+"]})
    build_task(cfg, {"start": 4})
    assert made == [(3, 2, ["+"]), (4, 1.0, None)]
    for options, message in [
        ({}, "[task] start is required by [grpo] task = 'my_counting:make'; add `start = ...` to the [task] section"),
        ({"start": 1, "zzz": 2}, "[task] has an unknown key 'zzz' for [grpo] task = 'my_counting:make'; "
                                 "it takes ops, start, step"),
        ({"start": 1.5}, "[task] start = 1.5 must be of type int for [grpo] task = 'my_counting:make'"),
        ({"start": 1, "ops": "+"}, "[task] ops = '+' must be of type list[str] | None"),
    ]:
        with pytest.raises(ValueError) as err:
            build_task(cfg, options)
        assert str(err.value).startswith(message)
    assert made == [(3, 2, ["+"]), (4, 1.0, None)]  # a refused section never reaches the factory


def test_arith_computes_each_operator_it_draws() -> None:
    """Every operator but "+" used to be computed as subtraction: "What is 3 * 4?" was answered -1."""
    problems = make_problems(300, seed=0, max_digits=2, ops="+-*")
    assert {p.question.split()[3] for p in problems} == {"+", "-", "*"}
    for p in problems:
        a, op, b = p.question.removeprefix("What is ").removesuffix("?").split()
        assert p.answer == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op], p
    assert build_task(GRPO(task_ops="*")).problems(1, 3) == [Problem("What is 3 * 9?", 27)]


@pytest.mark.parametrize(("ops", "message"), [
    ("+%", "[grpo] task_ops = '+%': '%' is not an operator arith computes; use any of '+-*'"),
    ("+/x", "[grpo] task_ops = '+/x': '/', 'x' is not an operator arith computes; use any of '+-*'"),
    ("", "[grpo] task_ops = '': is empty; use any of '+-*'"),
])
def test_arith_refuses_an_operator_it_does_not_compute_when_built(ops: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        build_task(GRPO(task_ops=ops))
    assert str(err.value) == message


def test_a_plug_in_factory_that_cannot_be_called_or_raises_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_section() -> EchoTask:
        return EchoTask()

    def broken(cfg: GRPO) -> EchoTask:
        raise KeyError("size")

    monkeypatch.setitem(sys.modules, "my_broken", types.SimpleNamespace(no_section=no_section, broken=broken))
    with pytest.raises(ValueError) as err:
        build_task(GRPO(task="my_broken:no_section"))
    assert str(err.value) == ("[grpo] task = 'my_broken:no_section': its factory cannot be called as "
                              "factory([grpo] section, **[task] section) (too many positional arguments); "
                              "give it that signature")
    with pytest.raises(ValueError) as err:
        build_task(GRPO(task="my_broken:broken"))
    assert str(err.value) == "[grpo] task = 'my_broken:broken': its factory raised KeyError: 'size'"
    assert isinstance(err.value.__cause__, KeyError), "the plug-in's traceback is kept"
