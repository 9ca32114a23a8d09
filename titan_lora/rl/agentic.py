"""The agentic example: a 2-turn calculator episode over the OpenAI chat API, on one adapter version.

Turn 1 asks the alias (`model=<lora_name>`, the newest version when the request arrives) and reads the
version that answered from `response.model` (`<lora_name>-v<step>`); when the reply calls the
calculator (`calculator.parse_tool_call`), the tool's result goes back as the next user message and
turn 2 pins that versioned name, so a sync in between changes nothing for this episode. A reply with
no tool call is the final answer. The reward is on the final answer only: 1.0 when its last number is
the problem's answer, 0.0 otherwise and when the final turn calls the tool again (one call is allowed).

This is a rollout and evaluation example, not a GRPO task: the loop trains on token-id completions of
one prompt, and a sound loss here would have to mask the tool's tokens between the model's turns.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Protocol

from titan_lora.clients.openai_rollout import ChatReply
from titan_lora.rl.calculator import CalcError, evaluate, format_value, parse_tool_call
from titan_lora.rl.task import Problem
from titan_lora.rl.tasks import exact_match

SYSTEM = ("You are a careful assistant with a calculator. To use it, reply with one line: "
          "CALC: <arithmetic expression>. You will get the result. Then reply with just the final number.")
# One worked exchange: a 135M model copies a format it has seen far more reliably than one it is told.
EXAMPLE = [
    {"role": "user", "content": "What is 23 * 17?"},
    {"role": "assistant", "content": "CALC: 23 * 17"},
    {"role": "user", "content": "Calculator result: 391"},
    {"role": "assistant", "content": "391"},
]
_VERSION = re.compile(r"-v(\d+)$")


class ChatClient(Protocol):
    """One chat completion under a model name (`OpenAIRolloutClient.chat`)."""

    def chat(self, model: str, messages: list[dict], max_tokens: int, temperature: float,
             seed: int | None = None) -> ChatReply:
        """The reply, and the model name that served it."""
        ...


@dataclasses.dataclass(frozen=True)
class Episode:
    """One calculator episode: every turn's reply, the tool call and its result, the reward, and the
    adapter version that served every turn."""

    problem: Problem
    replies: list[str]
    tool_call: str | None
    tool_result: str | None
    reward: float
    model: str
    """The served model name of every turn (a versioned adapter name, or the base model's)."""
    version: int | None
    """The adapter version of `model`; None when it is not `<name>-v<step>` (the base model)."""


def version_of(model: str) -> int | None:
    """The step of a versioned adapter name `<lora_name>-v<step>`, or None."""
    found = _VERSION.search(model)
    return int(found.group(1)) if found else None


def first_messages(problem: Problem) -> list[dict]:
    """The system prompt, the worked example and the question."""
    return [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": problem.question}]


def run_tool(expr: str) -> str:
    """What the calculator tells the model: the value, or why it could not compute one."""
    try:
        return format_value(evaluate(expr))
    except CalcError as err:
        return f"error: {err}"


def final_reward(final: str, problem: Problem) -> float:
    """1.0 when the final answer's last number is the answer; 0.0 when it calls the tool again."""
    return 0.0 if parse_tool_call(final) is not None else exact_match(final, problem)


def run_episode(chat: ChatClient, model: str, problem: Problem, *, max_tokens: int = 32,
                temperature: float = 0.0, seed: int | None = None,
                between_turns: Callable[[], None] | None = None) -> Episode:
    """Ask `problem` under `model` (the alias), run the tool call if there is one, and finish on the
    version that answered turn 1. `between_turns` runs after the tool, before turn 2 (a test's sync)."""
    messages = first_messages(problem)
    first = chat.chat(model, messages, max_tokens, temperature, seed)
    expr = parse_tool_call(first.text)
    if expr is None:
        return Episode(problem, [first.text], None, None, final_reward(first.text, problem), first.model,
                       version_of(first.model))
    result = run_tool(expr)
    if between_turns is not None:
        between_turns()
    messages += [{"role": "assistant", "content": first.text},
                 {"role": "user", "content": f"Calculator result: {result}"}]
    second = chat.chat(first.model, messages, max_tokens, temperature, None if seed is None else seed + 1)
    if second.model != first.model:
        raise RuntimeError(f"turn 2 asked for {first.model!r} and was served by {second.model!r}: the engine "
                           "does not pin versioned names")
    return Episode(problem, [first.text, second.text], expr, result, final_reward(second.text, problem),
                   first.model, version_of(first.model))
