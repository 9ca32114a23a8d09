"""GRPO over agent episodes (`[grpo] task` naming an `AgentTask`): a step's samples are the engine's records
of `group_size` episodes per problem (`rl/episode_rollouts.py`); the loss, the staleness weights and the
engine-gap check are GRPOObjective's, over the mask-1 tokens (`Sample.completion_mask`).

Both loops: the sync loop runs a step's groups under one lease; the async loop's producer draws one
problem's episodes as one group under the group's lease (`_draw_group`), so its staleness bound and
straggler rule apply to episode groups unchanged: the lease keeps the version live until the group's last
episode ends, and a group finished under too old a version is dropped and drawn again under the newest."""

from __future__ import annotations

import torch

from titan_lora.config import GRPO
from titan_lora.rl.agent_task import AgentTask
from titan_lora.rl.episode_rollouts import EpisodeEngine, heldout_metrics, run_all, run_episode_groups
from titan_lora.rl.episode_samples import EpisodeCounts, sum_counts
from titan_lora.rl.objective import GRPOObjective
from titan_lora.rl.rollout import Sample
from titan_lora.rl.sample_source import SourceFactory
from titan_lora.sync.engine_access import EngineRollouts
from titan_lora.sync.versions import Lease
from titan_lora.titan.parallel import DataParallelInfo


def check_agent_config(cfg: GRPO) -> None:
    """Refuse the `[grpo]` settings an agent task does not run under, naming the fix."""
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
                 loop: SourceFactory, record: str = "") -> None:
        check_agent_config(cfg)
        self.seq_len = seq_len
        self.counts = EpisodeCounts()
        self._group_counts: dict[int, EpisodeCounts] = {}  # rank 0: a drawn group's counts, until taken
        super().__init__(cfg, task, tokenizer, engine, dp, device, metrics_logger, loop, record)
        if engine is not None and engine.client is not None:
            self._clients()  # rank 0: an engine that cannot capture episodes fails now, not at step 1

    def _bind_task(self, task: AgentTask) -> None:
        self.agent = task  # its episodes write their own prompts and return their reward

    def _clients(self) -> EpisodeEngine:
        """Rank 0: the rollout client episodes run through (its `openai` client, episode routes and waits)."""
        if getattr(self.engine.client, "episode_routes", None) is None:
            raise ValueError("an agent task needs an engine that captures episodes: [engine] kind = \"vllm\" "
                             f"with one replica (this rollout client is a {type(self.engine.client).__name__})")
        return self.engine.client

    def _draw_step(self, problems: list, step: int) -> list[Sample]:
        engine = self._clients()
        with self.engine.versions.lease() as lease:
            samples, counts = run_episode_groups(self.agent, engine, lease, problems, self.cfg.group_size,
                                                 self.seq_len)
        # The step's groups run at once and are counted together: their counts go under its first group.
        self._group_counts[(step - 1) * self.cfg.prompts_per_step] = counts
        return samples

    def _draw_group(self, index: int, lease: Lease) -> list[Sample]:
        """Rank 0, a producer thread: the episodes of group `index` (prompt index % B of step index // B + 1)
        under `lease`, which the producer holds until they all end."""
        step, k = divmod(index, self.cfg.prompts_per_step)
        problem = self._problems_at(step + 1)[k]
        samples, counts = run_episode_groups(self.agent, self._clients(), lease, [problem],
                                             self.cfg.group_size, self.seq_len)
        for s in samples:
            s.group = index
        self._group_counts[index] = counts  # a redraw of a stale group replaces its counts
        return samples

    def _step_samples(self, step: int) -> list[Sample]:
        samples = super()._step_samples(step)
        # rank 0: what building the taken groups counted (the other ranks took none)
        taken = [i for i in self.source.taken if i in self._group_counts]
        self.counts = sum_counts(self._group_counts.pop(i) for i in taken)
        if not samples:  # shared: every rank raises alike
            raise RuntimeError(f"no episode of step {step} captured a sampled token: every chat completion of "
                               "run_episode must ask for the model it is given with extra_headers=headers")
        return samples

    def _heldout_eval(self) -> dict[str, float]:
        """Rank 0: the held-out episodes' mean reward (`eval/accuracy`) and the stats they report, under the
        active version (the agent's own sampling)."""
        engine = self._clients()
        with self.engine.versions.lease() as lease:
            return heldout_metrics(run_all(self.agent, engine, lease, self.heldout))

    def progress_fields(self, metrics: dict[str, float]) -> dict[str, str]:
        """GRPOObjective's, and the held-out episodes' stats when measured (`tool_call_rate=0.950`)."""
        stats = {k.removeprefix("eval/"): f"{v:.3f}" for k, v in metrics.items()
                 if k.startswith("eval/") and k not in ("eval/accuracy", "eval/failures")}
        return {**super().progress_fields(metrics), **stats}

    def after_step(self, step: int) -> dict[str, float]:
        """GRPOObjective's, and what building the step's samples from episodes counted (rank 0)."""
        metrics = super().after_step(step)
        on_rank0 = self.engine is not None and self.engine.client is not None
        return {**metrics, **self.counts.metrics()} if on_rank0 else metrics
