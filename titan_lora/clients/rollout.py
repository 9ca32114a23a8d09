"""The rollout side of an engine: sample completions and score sequences under a named adapter."""

from __future__ import annotations

import dataclasses
from typing import Protocol

from titan_lora.transfer.errors import TransferError

REFUSED_STATUSES = frozenset({400, 413, 422})
"""HTTP statuses that say the request itself is wrong (malformed, too large, a prompt over the engine's
max model length): every replica would refuse it. A 404 (an adapter the replica should hold) or a 5xx says
something of the replica."""


class RequestRefused(TransferError):
    """The engine refused the request itself (`REFUSED_STATUSES`): the request's error, not the engine's."""


@dataclasses.dataclass(frozen=True)
class Completion:
    """One sampled completion and the log-prob the engine gave each of its tokens."""

    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str = "stop"
    """"stop" (a stop string or token, or EOS) or "length" (cut at max_tokens)."""
    topk: list[list[tuple[int, float]]] | None = None
    """With `SampleSpec.sample_topk` k: each token's k likeliest (token id, log-prob), likeliest first."""


@dataclasses.dataclass(frozen=True)
class SampleSpec:
    """How to sample one prompt: the sampling parameters, and whether to score the prompt itself too."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    """Stop strings (kept at the end of the output); None: stop at EOS; (): not even at EOS."""
    stop_token_ids: tuple[int, ...] = ()
    prompt_logprobs: bool = False
    prompt_topk: int = 0
    """k > 0: each prompt token's k likeliest tokens too (`Samples.prompt_topk`)."""
    sample_topk: int = 0
    """k > 0: each sampled token's k likeliest tokens too (`Completion.topk`)."""


@dataclasses.dataclass(frozen=True)
class Samples:
    """`n` completions of one prompt; with `SampleSpec.prompt_logprobs`, log p(prompt token t | tokens < t)
    for every prompt token (None for the first)."""

    completions: list[Completion]
    prompt_logprobs: list[float | None] | None = None
    prompt_topk: list[list[tuple[int, float]] | None] | None = None
    """With `SampleSpec.prompt_topk` k: each prompt position's k likeliest (token id, log-prob), likeliest
    first (None for the first position)."""


class RolloutClient(Protocol):
    """What the RL loop and the parity probe need from an engine."""

    def generate(self, prompts: list[list[int]], adapter: str | None, max_tokens: int,
                 temperature: float, seed: int | None, stop_token_ids: list[int]) -> list[Completion]:
        """One completion per token-id prompt, sampled under `adapter` (None: the base)."""
        ...

    def score(self, sequences: list[list[int]], adapter: str | None) -> list[list[float]]:
        """log p(token t | tokens < t) for every token after the first of each sequence."""
        ...

    def interrupt(self, reason: str) -> None:
        """Fail every call waiting now with EngineHung (from another thread: the engine was found wedged)."""
        ...
