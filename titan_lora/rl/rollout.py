"""Rollouts: rank 0 samples groups from the engine under the active adapter version, then shares them.

A reward is evaluated per sample and never ends the run: an exception in it (a user's plug-in too), or a
value that is not a finite number, scores that sample 0, is logged once with the sample and is counted
(`Sample.reward_error`, reported per step as `rl/reward_errors`)."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from titan_lora.clients.rollout import RolloutClient
from titan_lora.rl.grpo import group_advantages
from titan_lora.rl.rewards import RewardFn
from titan_lora.rl.tasks import Problem
from titan_lora.sync.versions import Lease, ServedVersions

logger = logging.getLogger(__name__)
SHOWN_CHARS = 300
"""How much of a completion, and of the error, a reward error's log line shows."""


@dataclasses.dataclass
class Sample:
    """One sampled completion with its reward, advantage and the adapter version that produced it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    engine_logprobs: list[float]
    reward: float
    advantage: float
    version: int
    text: str
    reward_error: bool = False
    """The reward raised (or gave no finite number) on this sample, which scores 0."""
    group: int = -1
    """The group's place in data order (prompt g % B of step g // B + 1); -1: not from the GRPO loop."""
    trained_at: int | None = None
    """The step that trains it (set when a step takes it)."""
    completion_mask: list[int] | None = None
    """1 where the policy sampled the completion token, 0 for context inside it (an episode's tool and template
    tokens); None: every completion token was sampled."""

    @property
    def sampled_len(self) -> int:
        """How many of the completion's tokens the policy sampled (the tokens the loss covers)."""
        return len(self.completion_ids) if self.completion_mask is None else sum(self.completion_mask)


def _cut(text: str) -> str:
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def scores(reward: RewardFn, texts: Sequence[str], problems: Sequence[Problem],
           what: str) -> list[float | None]:
    """`reward(text, problem)` of each pair as a float; None where the reward raised or gave no finite
    number, each such sample logged once (the first with its traceback)."""
    out: list[float | None] = []
    for i, (text, problem) in enumerate(zip(texts, problems)):
        try:
            value = float(reward(text, problem))
            if not math.isfinite(value):
                raise ValueError(f"the reward returned {value}, not a finite number")
        except Exception as err:  # whatever a reply or a plug-in does, one sample must not end the run
            first = None not in out  # one traceback per batch: a broken plug-in fails on every sample
            logger.warning("%s: the reward failed on sample %d of %d (question %r, completion %s) with "
                           "%s: %s; it scores 0", what, i, len(texts), problem.question, repr(_cut(text)),
                           type(err).__name__, _cut(str(err)), exc_info=first)
            out.append(None)
        else:
            out.append(value)
    return out


def sample_groups(
    client: RolloutClient, versions: ServedVersions, problems: Sequence[Problem], prompt_ids: Sequence[list[int]],
    group_size: int, max_tokens: int, temperature: float, seed: int, stop_token_ids: list[int], reward: RewardFn,
) -> list[Sample]:
    """Rank 0: `group_size` completions per prompt under the active version, scored and normalised."""
    with versions.lease() as lease:  # the version cannot be retired while these requests run
        return draw_groups(client, lease, problems, prompt_ids, group_size, max_tokens, temperature, seed,
                           stop_token_ids, reward)


def draw_groups(
    client: RolloutClient, lease: Lease, problems: Sequence[Problem], prompt_ids: Sequence[list[int]],
    group_size: int, max_tokens: int, temperature: float, seed: int, stop_token_ids: list[int], reward: RewardFn,
) -> list[Sample]:
    """Rank 0: `group_size` completions per prompt under the leased version, scored and normalised; prompt k
    is sampled with seeds `seed + k * group_size + i`."""
    prompts = [ids for ids in prompt_ids for _ in range(group_size)]
    completions = client.generate(prompts, lease.name, max_tokens, temperature, seed, stop_token_ids)
    scored = scores(reward, [c.text for c in completions], [p for p in problems for _ in range(group_size)],
                    f"rollouts under {lease.name}")
    rewards = torch.tensor([0.0 if r is None else r for r in scored])
    advantages = group_advantages(rewards, group_size)
    return [
        Sample(prompts[i], c.token_ids, c.logprobs, float(rewards[i]), float(advantages[i]), lease.version,
               c.text, scored[i] is None)
        for i, c in enumerate(completions)
    ]


def share(samples: list[Sample] | None) -> list[Sample]:
    """Collective: every rank gets rank 0's samples."""
    box = [samples]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def greedy_accuracy(
    client: RolloutClient, adapter: str | None, problems: Sequence[Problem], prompt_ids: Sequence[list[int]],
    max_tokens: int, stop_token_ids: list[int], reward: RewardFn,
) -> float:
    """Rank 0: mean reward of greedy answers to held-out problems under `adapter` (one whose reward fails
    scores 0)."""
    completions = client.generate(list(prompt_ids), adapter, max_tokens, 0.0, None, stop_token_ids)
    what = f"held-out eval under {adapter or 'the base model'}"
    scored = scores(reward, [c.text for c in completions], problems, what)
    return sum(r or 0.0 for r in scored) / len(problems)
