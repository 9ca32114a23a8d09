"""The episodes an engine is capturing, bounded in count, bytes and idle time.

An episode lives from its first turn until the trainer deletes it (`protocol.DELETE_EPISODE`); one
nobody fetches (a crashed agent, a dropped group) is freed by the bounds, least recently used first,
and counted. The bounds are constants with an environment override read at engine start
(`EpisodeLimits.from_env`). A freed or deleted id is remembered (a bounded number of them) so that a
late fetch says what became of it.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Mapping

from titan_lora.engines.episode_log import CapturedTurn, EpisodeLog, Pin
from titan_lora.transfer.episodes import EpisodeRecord, UnknownEpisode

MAX_EPISODES_ENV = "TITAN_LORA_EPISODE_MAX_COUNT"
MAX_BYTES_ENV = "TITAN_LORA_EPISODE_MAX_BYTES"
IDLE_S_ENV = "TITAN_LORA_EPISODE_IDLE_S"
FORGOTTEN_KEPT = 1024  # ids remembered after they are freed or deleted, for the fetch's error message


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
    """How many episodes, how many bytes of them, and how long without a turn, before one is freed."""

    max_episodes: int = 4096
    """Far above the episodes a loop keeps in flight (64 prompts x 8 episodes x 2 versions = 1024)."""
    max_bytes: int = 512 * 2**20
    """17 bytes a token (`episode_log.BYTES_PER_TOKEN`): about 31M tokens, a ceiling against a client
    that never deletes, well below an engine host's memory."""
    idle_s: float = 1800.0
    """No turn for 30 min: abandoned. A tool call or a trainer's fetch takes seconds to minutes, and the
    loop's staleness bound retires a version long before."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> EpisodeLimits:
        """The defaults, with any of MAX_EPISODES_ENV, MAX_BYTES_ENV, IDLE_S_ENV that `env` sets; ValueError
        for one that is not a positive number."""
        try:
            limits = cls(int(env.get(MAX_EPISODES_ENV, cls.max_episodes)),
                         int(env.get(MAX_BYTES_ENV, cls.max_bytes)), float(env.get(IDLE_S_ENV, cls.idle_s)))
        except ValueError as err:
            raise ValueError(f"{MAX_EPISODES_ENV}, {MAX_BYTES_ENV} and {IDLE_S_ENV} must be numbers: "
                             f"{err}") from None
        if min(limits.max_episodes, limits.max_bytes, limits.idle_s) <= 0:
            raise ValueError(f"episode limits must be positive, got {limits} (from {MAX_EPISODES_ENV}, "
                             f"{MAX_BYTES_ENV}, {IDLE_S_ENV})")
        return limits


class EpisodeStore:
    """Episode logs by id, in least-recently-touched order, within `limits`."""

    def __init__(self, limits: EpisodeLimits = EpisodeLimits(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._logs: collections.OrderedDict[str, EpisodeLog] = collections.OrderedDict()
        self._touched: dict[str, float] = {}
        self._bytes = 0
        self._forgotten: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.freed: collections.Counter[str] = collections.Counter()  # by bound: idle, count, bytes
        self.deleted = 0

    def get(self, episode_id: str) -> EpisodeLog | None:
        """The live episode `episode_id`, touched (a turn is starting), or None."""
        self._free_over_bounds()
        log = self._logs.get(episode_id)
        if log is not None:
            self._touch(episode_id)
        return log

    def open(self, episode_id: str) -> EpisodeLog:
        """The episode `episode_id`, new if it is not live (noting it when the bounds freed it before)."""
        log = self.get(episode_id)
        if log is None:
            log = self._logs[episode_id] = EpisodeLog(episode_id)
            why = self._forgotten.pop(episode_id, None)
            if why is not None:
                log.note(f"its earlier turns are gone: {why}")
            self._touch(episode_id)
        return log

    def add_turn(self, episode_id: str, turn: CapturedTurn, pin: Pin) -> None:
        """Append `turn` to the episode; its first turn pins it to `pin` (the version that served it)."""
        log = self.open(episode_id)
        before = log.nbytes
        log.responses += 1
        if log.pin is None:
            log.pin = pin
        if turn.model != log.pin.model:  # two first turns raced, each on its own version
            log.note(f"response {log.responses}: served by {turn.model!r} while the episode runs on "
                     f"{log.pin.model!r}: not captured")
        else:
            log.append(turn)
        self._bytes += log.nbytes - before
        self._free_over_bounds()

    def note(self, episode_id: str, text: str) -> None:
        """Record on the episode why its response could not be captured."""
        log = self.open(episode_id)
        before = log.nbytes
        log.responses += 1
        log.note(f"response {log.responses}: {text}")
        self._bytes += log.nbytes - before

    def fetch(self, episode_id: str) -> EpisodeRecord:
        """The episode's record; UnknownEpisode says what became of an id that is not live."""
        log = self.get(episode_id)
        if log is None:
            raise UnknownEpisode(self._unknown(episode_id))
        return log.record()

    def delete(self, episode_id: str) -> bool:
        """Drop the episode (the trainer has it); False when it was not live."""
        if episode_id not in self._logs:
            return False
        self._forget(episode_id, "it was deleted")
        self.deleted += 1
        return True

    def stats(self) -> dict:
        """Live episodes and their bytes, those freed by each bound, those deleted, and the limits."""
        self._free_over_bounds()
        return {"live": len(self._logs), "bytes": self._bytes, "freed": dict(self.freed),
                "deleted": self.deleted, "limits": dataclasses.asdict(self.limits)}

    def _unknown(self, episode_id: str) -> str:
        why = self._forgotten.get(episode_id)
        if why is not None:
            return f"episode {episode_id!r} is no longer held: {why}"
        return (f"episode {episode_id!r} is unknown to this engine: no chat completion named it (header "
                "X-Titan-Episode), or it was freed long ago, or the engine restarted")

    def _touch(self, episode_id: str) -> None:
        self._logs.move_to_end(episode_id)
        self._touched[episode_id] = self._clock()

    def _forget(self, episode_id: str, why: str) -> None:
        log = self._logs.pop(episode_id)
        del self._touched[episode_id]
        self._bytes -= log.nbytes
        self._forgotten[episode_id] = why
        while len(self._forgotten) > FORGOTTEN_KEPT:
            self._forgotten.popitem(last=False)

    def _free_over_bounds(self) -> None:
        """Free abandoned episodes (idle past the bound), then the least recently touched while over the
        count or byte bound."""
        limits, now = self.limits, self._clock()
        while self._logs:
            oldest = next(iter(self._logs))
            if now - self._touched[oldest] > limits.idle_s:
                self._free(oldest, "idle", f"no turn for over {limits.idle_s:g} s ({IDLE_S_ENV})")
            elif len(self._logs) > limits.max_episodes:
                self._free(oldest, "count", f"over {limits.max_episodes} episodes held ({MAX_EPISODES_ENV})")
            elif self._bytes > limits.max_bytes:
                self._free(oldest, "bytes", f"over {limits.max_bytes} bytes of episodes held "
                                            f"({MAX_BYTES_ENV})")
            else:
                return

    def _free(self, episode_id: str, bound: str, why: str) -> None:
        self._forget(episode_id, f"the engine freed it, least recently used, when {why}")
        self.freed[bound] += 1
