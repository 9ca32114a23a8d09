"""Rollouts: rank 0 samples groups from the engine under the active adapter version, then shares them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist

from titan_lora.clients.rollout import RolloutClient
from titan_lora.rl.grpo import group_advantages
from titan_lora.rl.rewards import RewardFn
from titan_lora.rl.tasks import Problem
from titan_lora.sync.versions import ServedVersions


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


def sample_groups(
    client: RolloutClient, versions: ServedVersions, problems: Sequence[Problem], prompt_ids: Sequence[list[int]],
    group_size: int, max_tokens: int, temperature: float, seed: int, stop_token_ids: list[int], reward: RewardFn,
) -> list[Sample]:
    """Rank 0: `group_size` completions per prompt under the active version, scored and normalised."""
    prompts = [ids for ids in prompt_ids for _ in range(group_size)]
    with versions.lease() as lease:  # the version cannot be retired while these requests run
        completions = client.generate(prompts, lease.name, max_tokens, temperature, seed, stop_token_ids)
    rewards = torch.tensor([reward(c.text, problems[i // group_size]) for i, c in enumerate(completions)])
    advantages = group_advantages(rewards, group_size)
    return [
        Sample(prompts[i], c.token_ids, c.logprobs, float(rewards[i]), float(advantages[i]), lease.version, c.text)
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
    """Rank 0: mean reward of greedy answers to held-out problems under `adapter`."""
    completions = client.generate(list(prompt_ids), adapter, max_tokens, 0.0, None, stop_token_ids)
    return sum(reward(c.text, p) for c, p in zip(completions, problems)) / len(problems)
