"""Reward functions, selected in TOML (`[grpo] reward`): a registered name or `module:function`."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from titan_lora.rl.tasks import Problem, exact_match

RewardFn = Callable[[str, Problem], float]
_REWARDS: dict[str, RewardFn] = {"exact_match": exact_match}


def register_reward(name: str, fn: RewardFn) -> None:
    """Make `fn(completion_text, problem) -> float` available as `[grpo] reward = name`."""
    if name in _REWARDS:
        raise ValueError(f"reward {name!r} is already registered")
    _REWARDS[name] = fn


def get_reward(spec: str) -> RewardFn:
    """A registered reward, or `package.module:function` imported on demand."""
    if spec in _REWARDS:
        return _REWARDS[spec]
    if ":" in spec:
        module, _, attr = spec.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"[grpo] reward = {spec!r} cannot be imported: {err}") from None
    raise ValueError(
        f"[grpo] reward = {spec!r} is unknown; registered: {sorted(_REWARDS)}, "
        "or give an import path like 'my_pkg.rewards:score'"
    )
