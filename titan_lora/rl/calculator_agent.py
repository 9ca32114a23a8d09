"""The calculator agent task (`[grpo] task = "calculator_agent"`): 3-digit multiplication, which
SmolLM2-135M almost never gets right unaided, answered with the calculator tool over the OpenAI chat API.

Each episode is `agentic.run_episode` (the worked example, a `CALC:` tool call, the result as the next
message, the final answer on the version that answered turn 1) through the plain `openai` client, every
turn carrying the episode's headers so the engine records it. The reward is `agentic.final_reward`.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from titan_lora.clients.openai_rollout import ChatReply
from titan_lora.config import GRPO
from titan_lora.rl.agentic import run_episode
from titan_lora.rl.task import Problem


def multiplication_problems(n: int, seed: int, digits: int = 3) -> list[Problem]:
    """`n` seeded questions `a * b` with operands of exactly `digits` digits."""
    rng = random.Random(seed)
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    pairs = [(rng.randint(lo, hi), rng.randint(lo, hi)) for _ in range(n)]
    return [Problem(f"What is {a} * {b}?", a * b) for a, b in pairs]


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

    def run_episode(self, client: Any, model: str, headers: dict[str, str], problem: Problem) -> float:
        """The calculator episode's reward: 1.0 when its final answer is the product."""
        return run_episode(EpisodeChat(client, headers), model, problem, max_tokens=self.max_tokens,
                           temperature=self.temperature).reward


def calculator_agent_task(cfg: GRPO, *, digits: int = 3) -> CalculatorAgentTask:
    """The task from `[task] digits`, `[grpo] max_new_tokens` (per turn) and `temperature`."""
    if not 1 <= digits <= 9:
        raise ValueError(f"[task] digits = {digits} must be 1 to 9 for [grpo] task = \"calculator_agent\"")
    return CalculatorAgentTask(digits, cfg.max_new_tokens, cfg.temperature)
