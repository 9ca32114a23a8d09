"""Where a GRPO step's samples come from: one `SampleSource` per `[grpo] loop`, chosen once by name (`LOOPS`).

The sync loop draws a step's groups when the step asks for them; the async loop takes them from the
`RolloutProducer` that draws beside training (rl/producer.py). Each owns its start, what a step may train
on, its counters, its step-line fields, its data position in a checkpoint and its shutdown."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

from titan_lora.config import GRPO
from titan_lora.rl.producer import BusyClock, Draw, ProducerState, RolloutProducer
from titan_lora.rl.rollout import Sample
from titan_lora.sync.versions import ServedVersions


@dataclasses.dataclass(frozen=True)
class Draws:
    """The objective's ways to draw samples (rank 0), and the clock the engine's time goes on."""

    step: Callable[[int], list[Sample]]
    """The sync loop: step `step`'s groups at once (`Sample.group`: the prompt's index in the step)."""
    group: Draw
    """The async loop: group `index` under a lease."""
    versions: ServedVersions | None
    """The engine's published versions; None on the ranks that draw nothing."""
    clock: BusyClock


class SampleSource(Protocol):
    """What the GRPO objective asks of a loop."""

    def start(self, step: int) -> None:
        """Before the first step `step + 1`, once the engine serves the starting adapter."""
        ...

    def take(self, step: int) -> list[Sample]:
        """Rank 0, inside the engine call: step `step`'s samples (`Sample.group`: the group's data index)."""
        ...

    @property
    def taken(self) -> list[int]:
        """Rank 0: the groups the last `take` handed, in data order."""
        ...

    def trainable(self, samples: list[Sample], current: int) -> list[Sample]:
        """The samples a step at version `current` may train on (none older than max_staleness versions)."""
        ...

    def dropped(self) -> int:
        """Samples dropped as stale so far."""
        ...

    def after_step(self) -> None:
        """The step's version was just published."""
        ...

    def metrics(self) -> dict[str, float]:
        """Rank 0: the loop's counters for the step's metrics."""
        ...

    def progress_fields(self, metrics: dict[str, float]) -> dict[str, str]:
        """The loop's fields on the step line."""
        ...

    def data_state(self) -> dict | None:
        """Rank 0: the data position a checkpoint keeps (None: the step is it)."""
        ...

    def close(self) -> None:
        """Stop drawing."""
        ...


def fresh_samples(samples: list[Sample], current_version: int, max_staleness: int) -> list[Sample]:
    """The samples from versions >= current_version - max_staleness; raises when none is left."""
    fresh = [s for s in samples if s.version >= current_version - max_staleness]
    if samples and not fresh:
        versions = sorted({s.version for s in samples})
        raise RuntimeError(
            f"every one of the {len(samples)} samples is stale: they come from adapter versions {versions}, "
            f"the trainer is at version {current_version} and [grpo] max_staleness = {max_staleness}; the "
            "engine is not receiving new adapter versions (check [weight_sync] and the engine's log)"
        )
    return fresh


SourceFactory = Callable[[Draws], SampleSource]
"""A loop resumed from a checkpoint's data position, waiting for the objective's draws."""


class SyncSource:
    """The sync loop: a step draws its groups when it asks for them; stale samples are dropped and counted."""

    def __init__(self, cfg: GRPO, draws: Draws) -> None:
        self.cfg = cfg
        self.draws = draws
        self.dropped_stale = 0
        self._taken: list[int] = []

    @classmethod
    def resuming(cls, cfg: GRPO, data_state: dict | None) -> SourceFactory:
        """Refuse a checkpoint that kept a data position: the sync loop's position is the step."""
        if data_state:
            state = ProducerState(**data_state)
            raise ValueError(
                f'[grpo] loop = "sync" cannot resume this checkpoint: an async-loop run wrote it, with '
                f"groups below {state.next_group} and {len(state.trained_ahead)} above trained, which no "
                "step-based position matches (groups would be trained twice or skipped); resume with [grpo] "
                'loop = "async", or start a new run in another [job] dump_folder')
        return lambda draws: cls(cfg, draws)

    def start(self, step: int) -> None:
        """Nothing to start: a step draws its own groups."""

    def take(self, step: int) -> list[Sample]:
        """Rank 0: step `step`'s groups, drawn now; the step's group g is data index (step - 1) x B + g."""
        clock = self.draws.clock
        with clock.busy():
            samples = self.draws.step(step)
        clock.add_tokens(sum(len(s.completion_ids) for s in samples))
        first = (step - 1) * self.cfg.prompts_per_step
        for s in samples:
            s.group, s.trained_at = first + s.group, step
        self._taken = list(range(first, first + self.cfg.prompts_per_step))
        return samples

    @property
    def taken(self) -> list[int]:
        """Rank 0: the groups of the last step drawn."""
        return self._taken

    def trainable(self, samples: list[Sample], current: int) -> list[Sample]:
        """The fresh samples; the stale ones are dropped and counted."""
        fresh = fresh_samples(samples, current, self.cfg.max_staleness)
        self.dropped_stale += len(samples) - len(fresh)
        return fresh

    def dropped(self) -> int:
        """Samples dropped as stale so far."""
        return self.dropped_stale

    def after_step(self) -> None:
        """Nothing waits on a published version."""

    def metrics(self) -> dict[str, float]:
        """No counters beyond `rl/dropped_stale`."""
        return {}

    def progress_fields(self, metrics: dict[str, float]) -> dict[str, str]:
        """Nothing beyond the objective's."""
        return {}

    def data_state(self) -> dict | None:
        """None: the step is the data position."""
        return None

    def close(self) -> None:
        """Nothing runs between steps."""


class AsyncSource:
    """The async loop: rank 0's `RolloutProducer` draws while the ranks train; a step takes its groups."""

    def __init__(self, cfg: GRPO, draws: Draws, resume: ProducerState | None = None) -> None:
        self.cfg = cfg
        self.draws = draws
        self._resume = resume
        self.producer: RolloutProducer | None = None  # rank 0, from `start`

    @classmethod
    def resuming(cls, cfg: GRPO, data_state: dict | None) -> SourceFactory:
        """The producer resumes at the checkpoint's data position (None: at the step's)."""
        resume = ProducerState(**data_state) if data_state else None
        return lambda draws: cls(cfg, draws, resume)

    def start(self, step: int) -> None:
        """Rank 0: the producer starts drawing from the resumed data position."""
        if self.draws.versions is None:
            return
        state = self._resume or ProducerState.at_step(step, self.cfg.prompts_per_step)
        self.producer = RolloutProducer(self.draws.group, self.draws.versions, self.cfg.prompts_per_step,
                                        self.cfg.max_staleness, self.draws.clock, state)
        self.producer.start()

    def take(self, step: int) -> list[Sample]:
        """Rank 0: the producer's first B finished groups trainable at `step`."""
        return self.producer.take(step)

    @property
    def taken(self) -> list[int]:
        """Rank 0: the groups the last step took (none on the other ranks)."""
        return self.producer.last_taken if self.producer is not None else []

    def trainable(self, samples: list[Sample], current: int) -> list[Sample]:
        """All of them: the producer's admission and `take` never hand a sample older than S."""
        too_old = [s.version for s in samples if s.version < current - self.cfg.max_staleness]
        if too_old:  # a bug, never trained on
            raise RuntimeError(f"the async loop handed step {current + 1} samples of versions "
                               f"{sorted(set(too_old))}, older than [grpo] max_staleness = "
                               f"{self.cfg.max_staleness} allows")
        return samples

    def dropped(self) -> int:
        """Samples of the groups dropped as stale so far (the producer counts groups)."""
        return self._count("stale_dropped") * self.cfg.group_size

    def _count(self, name: str) -> int:
        return self.producer.counters[name] if self.producer is not None else 0

    def after_step(self) -> None:
        """The producer looks at the published version now: the step's slots are free."""
        if self.producer is not None:
            self.producer.poke()

    def metrics(self) -> dict[str, float]:
        """`rl/groups_<counter>`: what the producer admitted, dropped, drew again, skipped."""
        return {f"rl/groups_{k}": v for k, v in self.producer.counters.items()} if self.producer else {}

    def progress_fields(self, metrics: dict[str, float]) -> dict[str, str]:
        """`stale`: the mean and max staleness of the step's samples."""
        return {"stale": f"{metrics['rl/staleness_mean']:.2f}/{metrics['rl/staleness_max']:.0f}"}

    def data_state(self) -> dict | None:
        """Rank 0: the groups trained so far (`ProducerState`)."""
        return dataclasses.asdict(self.producer.state()) if self.producer is not None else None

    def close(self) -> None:
        """Stop the producer (requests in flight are left to the engine's shutdown)."""
        if self.producer is not None:
            self.producer.close()


LOOPS: dict[str, type[SyncSource] | type[AsyncSource]] = {"sync": SyncSource, "async": AsyncSource}
"""`[grpo] loop` -> its sample source."""


def sample_source(cfg: GRPO, data_state: dict | None = None) -> SourceFactory:
    """The loop `[grpo] loop` names, resumed from a checkpoint's `data_state` (refused where it cannot be)."""
    return LOOPS[cfg.loop].resuming(cfg, data_state)
