"""The rollout router: one `RolloutClient` over N independent replicas (`[engine] urls` or `replicas`).

A generate call is cut into runs of identical prompts (a GRPO group: one request with `n` samples, seed
`seed + index of its first prompt`, as on one engine); each run goes to the live replica that holds the
adapter it names and has the least work in flight (samples), so one step's groups spread over the
replicas. A request is pinned to its adapter's versioned name, which only replicas that acknowledged that
version are picked for. A replica whose request fails is quarantined and the run goes to another; when
none is left the call raises `NoLiveReplica`, which the syncer's recovery waits out (bounded). A request
the engine refuses itself (`RequestRefused`: a prompt over its max model length) is the request's error:
it is raised, naming the request, and no replica is quarantined (every one would refuse it).

This is only for independent engines at separate URLs: one vLLM engine scales out by itself with
`--data-parallel-size`, behind one URL, and needs no router.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from titan_lora.clients.openai_rollout import MAX_CONCURRENT, prompt_runs
from titan_lora.clients.replica_set import Replica, ReplicaSet
from titan_lora.clients.rollout import Completion, RequestRefused
from titan_lora.transfer.errors import TransferError

T = TypeVar("T")


class RolloutRouter:
    """Spreads rollouts and scoring over the live replicas of `replicas` that hold the adapter asked for."""

    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas
        self._pool = ThreadPoolExecutor(max_workers=MAX_CONCURRENT, thread_name_prefix="titan-router")

    def _routed(self, adapter: str | None, work: int, call: Callable[[Replica], T], sampled: bool,
                what: str) -> T:
        """`call` (the request `what`) on the least busy live replica holding `adapter`; on failure it is
        quarantined and the next one is tried, unless the engine refused the request itself."""
        tried: set[int] = set()
        while True:
            replica = self.replicas.pick(adapter, work, exclude=tried)  # raises when none is left
            try:
                out = call(replica)
            except BaseException as err:
                self.replicas.done(replica, work)
                if isinstance(err, RequestRefused):
                    raise RequestRefused(f"{what} under {adapter or 'the base'} was refused by {replica}, "
                                         f"and would be by every replica: {err}") from err
                if not isinstance(err, TransferError):
                    raise
                tried.add(replica.index)
                self.replicas.quarantine(replica, f"a request under {adapter or 'the base'} failed: {err}")
                continue
            self.replicas.done(replica, work, samples=work if sampled else 0)
            return out

    def interrupt(self, reason: str) -> None:
        """End the rollout requests in flight on every replica (each replica's own are ended when it is
        quarantined)."""
        self.replicas.each(lambda r: r.rollouts.interrupt(reason),
                           [r for r in self.replicas.replicas if r.rollouts is not None])

    def generate(self, prompts: list[list[int]], adapter: str | None, max_tokens: int,
                 temperature: float, seed: int | None, stop_token_ids: list[int]) -> list[Completion]:
        """One completion per token-id prompt under `adapter` (None: the base), each run of identical
        prompts on one replica."""
        def run(start: int, prompt: list[int], n: int) -> list[Completion]:
            run_seed = None if seed is None else seed + start
            return self._routed(adapter, n, lambda r: r.rollouts.generate(
                [prompt] * n, adapter, max_tokens, temperature, run_seed, stop_token_ids), sampled=True,
                what=f"sampling {n} completions of prompt {start} ({len(prompt)} tokens, "
                     f"up to {max_tokens} new)")

        futures = [self._pool.submit(run, start, prompt, n) for start, prompt, n in prompt_runs(prompts)]
        return [c for f in futures for c in f.result()]

    def score(self, sequences: list[list[int]], adapter: str | None) -> list[list[float]]:
        """Per-token log-probs of `sequences` under `adapter`, from one replica that holds it."""
        longest = max((len(s) for s in sequences), default=0)
        what = f"scoring {len(sequences)} sequences (longest: {longest} tokens)"
        return self._routed(adapter, len(sequences), lambda r: r.rollouts.score(sequences, adapter),
                            sampled=False, what=what)
