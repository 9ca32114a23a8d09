"""Agent tasks (`[grpo] task` naming one): a user's tool loop over the OpenAI chat API, trained on the
tokens the engine captured of each episode (docs/agents.md, "Training an agent").

An agent task is registered and built like any task (`register_task`, a factory taking `[grpo]` and the
`[task]` keys); what makes it an agent task is `run_episode` in place of `instruction` and `reward`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

from titan_lora.rl.task import Problem


@dataclasses.dataclass(frozen=True)
class EpisodeResult:
    """What `run_episode` may return in place of a bare reward: the reward and numbers about the episode,
    each averaged over the held-out episodes that report it and logged as `eval/<name>`."""

    reward: float
    stats: dict[str, float] = dataclasses.field(default_factory=dict)


@runtime_checkable
class AgentTask(Protocol):
    """What the GRPO loop needs from an agent task: problems, and one episode on one of them."""

    def problems(self, n: int, seed: int) -> list[Problem]:
        """`n` problems, the same for the same seed."""
        ...

    def run_episode(self, client: Any, model: str, headers: dict[str, str],
                    problem: Problem) -> float | EpisodeResult:
        """Run one episode of `problem` and return its reward (1.0 for a solved problem, by convention), or
        an `EpisodeResult` with the reward and the episode's stats for the held-out eval.

        `client` is an `openai.OpenAI` client of the engine; every chat completion of the episode asks for
        `model` and passes `extra_headers=headers`, which makes it a turn the engine records. The loop trains
        on what the engine sampled, so the episode may use any messages, tools and sampling it likes."""
        ...


def is_agent_task(task: object) -> bool:
    """Whether `task` runs episodes (an `AgentTask`) rather than scoring completions of one prompt."""
    return isinstance(task, AgentTask)
