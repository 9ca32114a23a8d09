"""The rollout side of an engine: sample completions and score sequences under a named adapter."""

from __future__ import annotations

import dataclasses
from typing import Protocol

from titan_lora.clients.base import Endpoint
from titan_lora.clients.http import JsonClient
from titan_lora.config import WeightSync
from titan_lora.transfer import protocol


@dataclasses.dataclass(frozen=True)
class Completion:
    """One sampled completion and the log-prob the engine gave each of its tokens."""

    token_ids: list[int]
    text: str
    logprobs: list[float]


class RolloutClient(Protocol):
    """What the RL loop and the parity probe need from an engine."""

    def generate(self, prompts: list[list[int]], adapter: str | None, max_tokens: int,
                 temperature: float, seed: int | None, stop_token_ids: list[int]) -> list[Completion]:
        """One completion per token-id prompt, sampled under `adapter` (None: the base)."""
        ...

    def score(self, sequences: list[list[int]], adapter: str | None) -> list[list[float]]:
        """log p(token t | tokens < t) for every token after the first of each sequence."""
        ...




class VLLMRolloutClient:
    """RolloutClient for a titan_lora vLLM engine; every call ends within `timeout_s` (the engine
    aborts what is still running then), `[weight_sync] rollout_timeout_s`."""

    def __init__(self, client: JsonClient, timeout_s: float = 600.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"[weight_sync] rollout_timeout_s must be positive, got {timeout_s}")
        self.client = client
        self.timeout_s = timeout_s

    def _post(self, route: str, body: dict) -> dict:
        return self.client.post(route, {**body, "timeout_s": self.timeout_s},
                                timeout_s=self.timeout_s + protocol.HTTP_MARGIN_S)

    def generate(self, prompts: list[list[int]], adapter: str | None, max_tokens: int,
                 temperature: float, seed: int | None, stop_token_ids: list[int]) -> list[Completion]:
        """Sample completions through `/titan/generate`."""
        reply = self._post(protocol.path(protocol.GENERATE), {
            "prompts": prompts, "adapter": adapter, "max_tokens": max_tokens,
            "temperature": temperature, "seed": seed, "stop_token_ids": stop_token_ids,
        })
        if len(reply["outputs"]) != len(prompts):
            raise RuntimeError(f"asked for {len(prompts)} completions, the engine returned {len(reply['outputs'])}")
        if reply["adapter"] != adapter:
            raise RuntimeError(f"asked for adapter {adapter!r}, the engine answered with {reply['adapter']!r}")
        return [Completion(o["token_ids"], o["text"], o["logprobs"]) for o in reply["outputs"]]

    def score(self, sequences: list[list[int]], adapter: str | None) -> list[list[float]]:
        """Prompt log-probs through `/titan/score`."""
        return self._post(protocol.path(protocol.SCORE), {"sequences": sequences, "adapter": adapter})["logprobs"]


def vllm_rollouts(endpoint: Endpoint, ws: WeightSync) -> VLLMRolloutClient:
    """The rollout client of a titan_lora vLLM engine at `endpoint`."""
    return VLLMRolloutClient(JsonClient(endpoint.url, endpoint.api_key, ws.timeout_s), ws.rollout_timeout_s)
