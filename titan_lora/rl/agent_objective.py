"""GRPO over agent episodes (`[grpo] task` naming an `AgentTask`), sync loop: a step's samples are the
engine's records of `group_size` episodes per problem (`rl/episode_rollouts.py`); the loss, the staleness
weights and the engine-gap check are GRPOObjective's, over the mask-1 tokens (`Sample.completion_mask`)."""

from __future__ import annotations

from typing import Any

import torch

from titan_lora.clients.http import JsonClient
from titan_lora.config import GRPO
from titan_lora.rl.agent_task import AgentTask
from titan_lora.rl.episode_rollouts import run_all, run_episode_groups
from titan_lora.rl.episode_samples import EpisodeCounts
from titan_lora.rl.objective import GRPOObjective
from titan_lora.rl.rollout import Sample
from titan_lora.sync.engine_access import EngineRollouts
from titan_lora.titan.parallel import DataParallelInfo


def check_agent_config(cfg: GRPO) -> None:
    """Refuse the `[grpo]` settings an agent task does not run under, naming the fix."""
    if cfg.loop != "sync":
        raise ValueError(f"[grpo] loop = {cfg.loop!r} does not run agent tasks yet (only the sync loop does); "
                         "set [grpo] loop = \"sync\"")
    if not cfg.rollouts:
        raise ValueError("[grpo] rollouts = false leaves an agent task no episodes to train on; "
                         "set [grpo] rollouts = true")
    if cfg.reward:
        raise ValueError(f"[grpo] reward = {cfg.reward!r} is set, but an agent task's run_episode returns the "
                         "reward; remove [grpo] reward")


class AgentObjective(GRPOObjective):
    """GRPO whose groups are episodes of one problem; `seq_len` (`[training] seq_len`) bounds a sequence."""

    def __init__(self, cfg: GRPO, task: AgentTask, tokenizer, engine: EngineRollouts | None,  # noqa: ANN001
                 dp: DataParallelInfo, device: torch.device, metrics_logger, seq_len: int,  # noqa: ANN001
                 record: str = "") -> None:
        check_agent_config(cfg)
        self.seq_len = seq_len
        self.counts = EpisodeCounts()
        super().__init__(cfg, task, tokenizer, engine, dp, device, metrics_logger, None, record)
        if engine is not None and engine.client is not None:
            self._clients()  # rank 0: an engine that cannot capture episodes fails now, not at step 1

    def _bind_task(self, task: AgentTask) -> None:
        self.agent = task  # its episodes write their own prompts and return their reward

    def _clients(self) -> tuple[Any, JsonClient]:
        """Rank 0: the `openai` client the agent gets and the client of the engine's episode routes."""
        routes = getattr(self.engine.client, "episode_routes", None)
        if routes is None:
            raise ValueError("an agent task needs an engine that captures episodes: [engine] kind = \"vllm\" "
                             f"with one replica (this rollout client is a {type(self.engine.client).__name__})")
        return self.engine.client.client, routes()

    def _draw_step(self, problems: list, step: int) -> list[Sample]:
        api, routes = self._clients()
        with self.engine.versions.lease() as lease:
            samples, self.counts = run_episode_groups(self.agent, api, routes, lease, problems,
                                                      self.cfg.group_size, self.seq_len)
        if not samples:
            raise RuntimeError(f"no episode of step {step} captured a sampled token: every chat completion of "
                               "run_episode must ask for the model it is given with extra_headers=headers")
        return samples

    def _greedy_accuracy(self) -> float:
        """Rank 0: the held-out episodes' mean reward under the active version (the agent's own sampling)."""
        api, routes = self._clients()
        with self.engine.versions.lease() as lease:
            outcomes = run_all(self.agent, api, routes, lease, self.heldout)
        return sum(o.reward for o in outcomes) / len(outcomes)

    def after_step(self, step: int) -> dict[str, float]:
        """GRPOObjective's, and what building the step's samples from episodes counted (rank 0)."""
        metrics = super().after_step(step)
        on_rank0 = self.engine is not None and self.engine.client is not None
        return {**metrics, **self.counts.metrics()} if on_rank0 else metrics
