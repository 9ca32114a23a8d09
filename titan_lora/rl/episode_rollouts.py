"""Rank 0, sync loop: the step's groups of agent episodes, run concurrently under one leased version,
each episode's record fetched from the engine and deleted, scored and turned into samples.

An agent that raises scores 0 (like a failing reward, `Sample.reward_error`) and the turns captured before
the error are trained; an agent that loses the engine (the `openai` client's connection or timeout errors, or
an HTTP 5xx: `clients.openai_rollout.engine_failure`) raises instead, so the loop's engine recovery runs and
the step is drawn again. An episode's turns run while its caller waits in the rollout client's `wait_for`, and
its record is fetched over the client's `episode_routes`, so a wedged engine's `interrupt` ends both at once
(EngineHung) instead of at `rollout_timeout_s`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import torch

from titan_lora.clients.episodes import delete_episode, episode_headers, fetch_episode, new_episode_id
from titan_lora.clients.http import JsonClient
from titan_lora.clients.openai_rollout import engine_failure
from titan_lora.rl.agent_task import AgentTask, EpisodeResult
from titan_lora.rl.episode_samples import EpisodeCounts, episode_samples
from titan_lora.rl.grpo import group_advantages
from titan_lora.rl.rollout import Sample
from titan_lora.rl.task import Problem
from titan_lora.sync.versions import Lease
from titan_lora.transfer.episodes import EpisodeRecord, UnknownEpisode
from titan_lora.transfer.errors import EngineHung

logger = logging.getLogger(__name__)
MAX_EPISODES_AT_ONCE = 32
"""Episodes in flight at once: each holds one request at a time, and the engine batches them."""
T = TypeVar("T")


class EpisodeEngine(Protocol):
    """What episodes need of the engine's rollout client (`OpenAIRolloutClient`)."""

    @property
    def client(self) -> Any:
        """The `openai.OpenAI` client an agent's turns go through."""
        ...

    def episode_routes(self) -> JsonClient:
        """The client of the engine's episode-record routes."""
        ...

    def wait_for(self, fn: Callable[[], T]) -> T:
        """`fn()` run while the caller waits; the client's `interrupt` ends the wait with EngineHung."""
        ...


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One finished episode: its record (no segments when nothing was captured), reward, whether the agent
    raised, and the stats it reported (`EpisodeResult.stats`)."""

    record: EpisodeRecord
    reward: float
    error: bool
    stats: dict[str, float] = dataclasses.field(default_factory=dict)


def _reward(agent: AgentTask, api: Any, lease: Lease, episode: str,
            problem: Problem) -> tuple[float, bool, dict[str, float]]:
    """(reward, whether the agent failed, its stats) of one episode; a lost engine raises."""
    try:
        result = agent.run_episode(api, lease.name, episode_headers(episode), problem)
        if not isinstance(result, EpisodeResult):
            result = EpisodeResult(float(result))
        reward = float(result.reward)
        if not math.isfinite(reward):
            raise ValueError(f"run_episode returned {reward}, not a finite number")
        return reward, False, dict(result.stats)
    except Exception as err:  # a user's tool loop: one episode must not end the run, a lost engine must recover
        lost = engine_failure(err, "an agent's request to the engine")
        if lost is not None:
            raise lost from err
        logger.warning("episode %s (question %r) failed with %s: %s; it scores 0 and its captured turns are "
                       "trained", episode, problem.question, type(err).__name__, err, exc_info=True)
        return 0.0, True, {}


def run_one(agent: AgentTask, engine: EpisodeEngine, lease: Lease, problem: Problem) -> Outcome:
    """Run one episode under `lease`, then fetch and delete its record."""
    episode = new_episode_id()
    api, routes = engine.client, engine.episode_routes()
    hung = False
    try:
        reward, error, stats = engine.wait_for(lambda: _reward(agent, api, lease, episode, problem))
        try:
            record = fetch_episode(routes, episode)
        except UnknownEpisode as err:  # no turn carried the headers, or the engine's bounds freed it
            logger.warning("episode %s has no record on the engine (%s); nothing of it is trained", episode, err)
            record = EpisodeRecord(episode, None, None, (), ())
    except EngineHung:
        hung = True  # a delete would wait out the timeout too; the engine's bounds free the record
        raise
    finally:
        if not hung:
            delete_episode(routes, episode)
    if record.segments and record.version != lease.version:
        raise RuntimeError(f"episode {episode} ran on {record.model!r}, not on {lease.name!r}: an agent's turns "
                           "must ask for the model run_episode is given")
    return Outcome(record, reward, error, stats)


def run_all(agent: AgentTask, engine: EpisodeEngine, lease: Lease,
            problems: Sequence[Problem]) -> list[Outcome]:
    """One episode per problem under `lease`, concurrently, in the order of `problems`."""
    failed = threading.Event()

    def one(problem: Problem) -> Outcome:
        if failed.is_set():  # an episode queued behind a failed one would only meet the same engine
            raise CancelledError("an earlier episode of this call failed")
        try:
            return run_one(agent, engine, lease, problem)
        except BaseException:
            failed.set()
            raise

    with ThreadPoolExecutor(max_workers=max(1, min(len(problems), MAX_EPISODES_AT_ONCE)),
                            thread_name_prefix="titan-episode") as pool:
        return list(pool.map(one, problems))  # raises the first failure: those queued after it are later


def heldout_metrics(outcomes: Sequence[Outcome]) -> dict[str, float]:
    """`eval/accuracy` (the mean reward) and each stat's mean over the episodes that report it."""
    reported: dict[str, list[float]] = {}
    for o in outcomes:
        for name, value in o.stats.items():
            reported.setdefault(name, []).append(value)
    stats = {f"eval/{name}": sum(values) / len(values) for name, values in sorted(reported.items())}
    return {"eval/accuracy": sum(o.reward for o in outcomes) / max(len(outcomes), 1), **stats}


def run_episode_groups(agent: AgentTask, engine: EpisodeEngine, lease: Lease, problems: Sequence[Problem],
                       group_size: int, seq_len: int) -> tuple[list[Sample], EpisodeCounts]:
    """`group_size` episodes per problem under `lease`, concurrently; the samples (`Sample.group`: the
    problem's index in `problems`) and what building them counted."""
    outcomes = run_all(agent, engine, lease, [p for p in problems for _ in range(group_size)])
    rewards = [o.reward for o in outcomes]
    advantages = group_advantages(torch.tensor(rewards), group_size).tolist()
    counts = EpisodeCounts(agent_errors=sum(o.error for o in outcomes), reward_sum=sum(rewards))
    samples = []
    for i, (outcome, advantage) in enumerate(zip(outcomes, advantages)):
        for s in episode_samples(outcome.record, outcome.reward, advantage, seq_len, counts):
            s.group, s.reward_error = i // group_size, outcome.error
            samples.append(s)
    return samples, counts
