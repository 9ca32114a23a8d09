"""The calculator agent task (`[grpo] task = "calculator_agent"`): 3-digit multiplication, which
SmolLM2-135M almost never gets right unaided, answered with the calculator tool over the OpenAI chat API.

Each episode is `agentic.run_episode` (the worked example, a `CALC:` tool call, the result as the next
message, the final answer on the version that answered turn 1) through the plain `openai` client, every
turn carrying the episode's headers so the engine records it. The reward is `agentic.final_reward`; the
held-out eval also reports how often the tool is called and how often the answer copies its result
(`episode_stats`), which tells a base that skips the tool from one that misreads it.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from titan_lora.clients.openai_rollout import ChatReply
from titan_lora.config import GRPO
from titan_lora.rl.agent_task import EpisodeResult
from titan_lora.rl.agentic import Episode, run_episode
from titan_lora.rl.extract import last_number
from titan_lora.rl.task import Problem


def multiplication_problems(n: int, seed: int, digits: int = 3) -> list[Problem]:
    """`n` seeded questions `a * b` with operands of exactly `digits` digits."""
    rng = random.Random(seed)
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    pairs = [(rng.randint(lo, hi), rng.randint(lo, hi)) for _ in range(n)]
    return [Problem(f"What is {a} * {b}?", a * b) for a, b in pairs]


def episode_stats(episode: Episode) -> dict[str, float]:
    """`tool_call_rate`: 1.0 when the episode called the calculator; `tool_copy_share`, only for an episode
    whose calculator answered with a number: 1.0 when the final answer's last number is that number."""
    stats = {"tool_call_rate": float(episode.tool_call is not None)}
    result = last_number(episode.tool_result or "")
    if result is not None and not episode.tool_result.startswith("error"):
        stats["tool_copy_share"] = float(last_number(episode.replies[-1]) == result)
    return stats


@dataclasses.dataclass(frozen=True)
class EpisodeChat:
    """`agentic.ChatClient` over an `openai.OpenAI` client: every turn carries the episode's headers."""

    api: Any
    headers: dict[str, str]

    def chat(self, model: str, messages: list[dict], max_tokens: int, temperature: float,
             seed: int | None = None) -> ChatReply:
        """One turn of the episode."""
        reply = self.api.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                 temperature=temperature, seed=seed, extra_headers=self.headers)
        return ChatReply(reply.model, reply.choices[0].message.content or "")


@dataclasses.dataclass(frozen=True)
class CalculatorAgentTask:
    """Multiplication of `digits`-digit operands with the calculator; turns sampled at `temperature`, at most
    `max_tokens` tokens each."""

    digits: int = 3
    max_tokens: int = 32
    temperature: float = 1.0

    def problems(self, n: int, seed: int) -> list[Problem]:
        """`n` seeded problems."""
        return multiplication_problems(n, seed, self.digits)

    def run_episode(self, client: Any, model: str, headers: dict[str, str], problem: Problem) -> EpisodeResult:
        """The calculator episode's reward (1.0 when its final answer is the product) and `episode_stats`."""
        episode = run_episode(EpisodeChat(client, headers), model, problem, max_tokens=self.max_tokens,
                              temperature=self.temperature)
        return EpisodeResult(episode.reward, episode_stats(episode))


def calculator_agent_task(cfg: GRPO, *, digits: int = 3) -> CalculatorAgentTask:
    """The task from `[task] digits`, `[grpo] max_new_tokens` (per turn) and `temperature`."""
    if not 1 <= digits <= 9:
        raise ValueError(f"[task] digits = {digits} must be 1 to 9 for [grpo] task = \"calculator_agent\"")
    return CalculatorAgentTask(digits, cfg.max_new_tokens, cfg.temperature)
