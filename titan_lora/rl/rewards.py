"""Reward functions, selected in TOML (`[grpo] reward`): a registered name or `module:function`.

Empty (the default) uses the task's own reward. A reward that raises on a sample, or returns no finite
number, scores that sample 0: logged with the sample and counted in `rl/reward_errors`, it never ends the
run (`rollout.scores`)."""

from __future__ import annotations

from collections.abc import Callable

from titan_lora.registry import Registry
from titan_lora.rl.task import Problem

RewardFn = Callable[[str, Problem], float]
_REWARDS: Registry[RewardFn] = Registry("[grpo] reward", "reward", {"exact_match": "titan_lora.rl.tasks:exact_match"})


def register_reward(name: str, fn: RewardFn) -> None:
    """Make `fn(completion_text, problem) -> float` available as `[grpo] reward = name`."""
    _REWARDS.register(name, fn)


def get_reward(spec: str) -> RewardFn:
    """A registered reward, or `package.module:function` imported on demand."""
    return _REWARDS.get(spec)
