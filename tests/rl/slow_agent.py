"""A test's agent task (`[grpo] task = "slow_agent:slow_calculator"`, tests/rl on PYTHONPATH): the calculator
agent with every turn's asked and served model logged to `$TITAN_LORA_TEST_TURN_LOG`, and its first episode
held after its turns until the engine serves version `HOLD_UNTIL`, then asked once more by the alias: its
group finishes too old to train (the async loop's straggler) and the late turn shows the episode's pin."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from typing import Any

from titan_lora.clients.openai_rollout import ChatReply
from titan_lora.config import GRPO
from titan_lora.rl.agent_task import EpisodeResult
from titan_lora.rl.agentic import first_messages, run_episode, version_of
from titan_lora.rl.calculator_agent import CalculatorAgentTask, EpisodeChat, episode_stats
from titan_lora.rl.task import Problem
from titan_lora.transfer.protocol import EPISODE_HEADER

LOG_ENV = "TITAN_LORA_TEST_TURN_LOG"
HOLD_UNTIL = 2  # with max_staleness 1, a group drawn under version 0 finishing after step 2 is stale
HOLD_TIMEOUT_S = 300
_first = threading.Lock()  # the first episode to take it is held; nobody releases it


def log_turn(**line: Any) -> None:
    with open(os.environ[LOG_ENV], "a") as f:
        f.write(json.dumps({**line, "at": time.time()}) + "\n")


@dataclasses.dataclass(frozen=True)
class LoggedChat(EpisodeChat):
    """EpisodeChat, each turn's asked and served model logged."""

    def chat(self, model: str, messages: list[dict], max_tokens: int, temperature: float,
             seed: int | None = None) -> ChatReply:
        reply = super().chat(model, messages, max_tokens, temperature, seed)
        log_turn(episode=self.headers[EPISODE_HEADER], asked=model, served=reply.model)
        return reply


def newest_version(api: Any) -> int:
    return max((v for m in api.models.list().data if (v := version_of(m.id)) is not None), default=-1)


@dataclasses.dataclass(frozen=True)
class SlowCalculatorTask(CalculatorAgentTask):
    """The calculator agent; its first episode is held (see the module)."""

    def run_episode(self, client: Any, model: str, headers: dict[str, str], problem: Problem) -> EpisodeResult:
        chat = LoggedChat(client, headers)
        episode = run_episode(chat, model, problem, max_tokens=self.max_tokens, temperature=self.temperature)
        if _first.acquire(blocking=False):
            deadline = time.monotonic() + HOLD_TIMEOUT_S
            while newest_version(client) < HOLD_UNTIL and time.monotonic() < deadline:
                time.sleep(0.2)
            log_turn(episode=headers[EPISODE_HEADER], held_until=newest_version(client))
            alias = model.rsplit("-v", 1)[0]  # the newest version outside the episode
            chat.chat(alias, first_messages(problem), self.max_tokens, self.temperature)
        return EpisodeResult(episode.reward, episode_stats(episode))


def slow_calculator(cfg: GRPO, *, digits: int = 3) -> SlowCalculatorTask:
    """The task from `[grpo] max_new_tokens` and `temperature`."""
    return SlowCalculatorTask(digits, cfg.max_new_tokens, cfg.temperature)
