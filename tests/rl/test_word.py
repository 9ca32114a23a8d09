"""Word problems (`[grpo] task = "word_problems"`): seeded stories whose answers follow from their text."""

from __future__ import annotations

import re

import pytest

from titan_lora.config import GRPO
from titan_lora.rl.task import Problem, build_task, train_and_heldout
from titan_lora.rl.word import GAINS, LOSSES, WordProblemsTask

_GAIN = "|".join(g.replace("{n}", r"(\d+)") for g in GAINS)
_LOSS = "|".join(g.replace("{n}", r"(\d+)") for g in LOSSES)


def recompute(question: str) -> tuple[int, int]:
    """(the answer, the number of steps), read from the question text alone."""
    start = re.match(r"(\w+) has (\d+) (\w+)\.", question)
    name, count, item = start.group(1), int(start.group(2)), start.group(3)
    steps = re.findall(rf"Then {name} (?:{_GAIN}|{_LOSS})\.", question)
    for groups in steps:
        gains, losses = groups[: len(GAINS)], groups[len(GAINS):]
        count += sum(int(g) for g in gains if g) - sum(int(g) for g in losses if g)
    assert question.endswith(f"How many {item} does {name} have now?")
    return count, len(steps)


@pytest.mark.parametrize(("steps", "max_number"), [(1, 9), (2, 9), (3, 20)])
def test_problems_are_seeded_and_their_answers_follow_from_the_text(steps: int, max_number: int) -> None:
    task = WordProblemsTask(steps, max_number)
    problems = task.problems(300, seed=5)
    assert problems == task.problems(300, seed=5) and problems != task.problems(300, seed=6)
    for p in problems:
        answer, n_steps = recompute(p.question)
        assert (p.answer, n_steps) == (answer, steps) and 0 <= p.answer <= max_number * (steps + 1)
        assert all(1 <= int(n) <= max_number for n in re.findall(r"\d+", p.question))
    assert len({p.question for p in problems}) > 250  # enough distinct stories for a train / held-out split


def test_the_first_problems_of_seed_0_are_fixed() -> None:
    """Changing the generator changes every recorded base accuracy: this pins it."""
    assert WordProblemsTask().problems(2, seed=0) == [
        Problem("Max has 2 cards. Then Max finds 5 more. Then Max finds 7 more. "
                "How many cards does Max have now?", 14),
        Problem("Ivy has 5 coins. Then Ivy gives away 5. Then Ivy finds 2 more. "
                "How many coins does Ivy have now?", 2),
    ]


@pytest.mark.parametrize(("completion", "reward"), [
    ("9", 1.0), ("Sam has 7 + 5 - 3 = 9 apples.", 1.0), ("9 apples, or 10", 0.0), ("nine", 0.0), ("", 0.0),
])
def test_the_reward_is_the_last_number(completion: str, reward: float) -> None:
    assert WordProblemsTask().reward(completion, Problem("q", 9)) == reward


def test_the_task_section_sets_the_difficulty_and_the_split_is_disjoint() -> None:
    cfg = GRPO(task="word_problems")
    assert build_task(cfg) == WordProblemsTask(2, 9)
    assert build_task(cfg, {"steps": 3, "max_number": 20}) == WordProblemsTask(3, 20)
    train, held = train_and_heldout(build_task(cfg), 2000, 100, seed=0)
    assert len(train) == 2000 and not {p.question for p in train} & {p.question for p in held}
    with pytest.raises(ValueError, match=r"^\[task\] steps = 0: use an integer >= 1"):
        build_task(cfg, {"steps": 0})
    with pytest.raises(ValueError, match=r"^\[task\] max_number = True must be of type int"):
        build_task(cfg, {"max_number": True})


@pytest.mark.parametrize("max_number", [1, 0, -3])
def test_a_max_number_no_story_can_start_from_is_refused_before_the_model_is_built(max_number: int) -> None:
    from model_helpers import DEBUG_LORA, job_config_from

    from titan_lora.compose import check_plugins

    with pytest.raises(ValueError) as err:
        build_task(GRPO(task="word_problems"), {"max_number": max_number})
    assert str(err.value) == (f"[task] max_number = {max_number}: use an integer >= 2 "
                              "(defaults: steps = 2, max_number = 9)")
    cfg = job_config_from(DEBUG_LORA + '[grpo]\nenabled = true\nrollouts = false\ntask = "word_problems"\n'
                          f"[task]\nmax_number = {max_number}\n")
    with pytest.raises(ValueError, match=rf"^\[task\] max_number = {max_number}: use an integer >= 2"):
        check_plugins(cfg)
    assert build_task(GRPO(task="word_problems"), {"max_number": 2}).problems(50, seed=0)[0].answer >= 0


def test_the_shipped_config_runs_word_problems_with_room_for_the_answers() -> None:
    from pathlib import Path

    from titan_lora.compose import check_plugins, configured_task
    from titan_lora.trainer.job_config import load_job_config

    path = Path(__file__).resolve().parents[2] / "train_configs/smollm2_grpo_word.toml"
    cfg = load_job_config(["--job.config_file", str(path)])
    check_plugins(cfg)
    assert configured_task(cfg) == WordProblemsTask(steps=2, max_number=9)
    assert cfg.grpo.max_new_tokens >= 24  # 8 tokens cut 2-digit answers and their working short
