"""One episode's token stream as the engine builds it, turn by turn (`transfer.episodes` says the rules).

Kept in typed arrays: an id and a log-prob take 8 bytes each and a mask entry 1, so the store's byte
bound counts what is really held.
"""

from __future__ import annotations

import array
import dataclasses
from collections.abc import Sequence

from titan_lora.transfer.episodes import EpisodeRecord, Segment, Turn

BYTES_PER_TOKEN = 8 + 8 + 1  # id (int64), log-prob (float64), mask (int8)


@dataclasses.dataclass(frozen=True)
class Pin:
    """The served version an episode runs on, and the alias a later turn may ask for it by."""

    model: str
    alias: str | None
    version: int | None


@dataclasses.dataclass(frozen=True)
class CapturedTurn:
    """What one chat-completion response says about its turn."""

    prompt_ids: list[int]
    sampled_ids: list[int]
    logprobs: list[float]
    model: str
    finish_reason: str | None


class _SegmentLog:
    def __init__(self, why_new: str | None) -> None:
        self.ids = array.array("q")
        self.mask = array.array("b")
        self.logprobs = array.array("d")
        self.why_new = why_new

    def extend(self, ids: Sequence[int], mask: int, logprobs: Sequence[float] | None = None) -> None:
        self.ids.extend(ids)
        self.mask.extend([mask] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))

    def frozen(self) -> Segment:
        return Segment(tuple(self.ids), tuple(self.mask), tuple(self.logprobs), self.why_new)


def first_difference(prompt: Sequence[int], stream: Sequence[int]) -> int | None:
    """The first position where `prompt` does not extend `stream`, or None when it does."""
    for i, (a, b) in enumerate(zip(prompt, stream)):
        if a != b:
            return i
    return None if len(prompt) >= len(stream) else len(prompt)


class EpisodeLog:
    """The segments, turns, pinned model and notes of one episode, appended to turn by turn."""

    def __init__(self, episode_id: str) -> None:
        self.episode_id = episode_id
        self.pin: Pin | None = None
        self._segments: list[_SegmentLog] = []
        self._turns: list[Turn] = []
        self.notes: list[str] = []
        self.nbytes = 0
        self.responses = 0  # responses seen, captured or not (the store counts them): notes name one

    def append(self, captured: CapturedTurn) -> Turn:
        """Add one turn: the new context ids (mask 0) and the sampled ids (mask 1) to the current segment
        when its prompt extends it exactly, else a new segment that says where they differ."""
        prompt_ids, sampled_ids, logprobs = captured.prompt_ids, captured.sampled_ids, captured.logprobs
        if len(logprobs) != len(sampled_ids):
            raise ValueError(f"{len(sampled_ids)} sampled ids but {len(logprobs)} log-probs")
        current = self._segments[-1] if self._segments else None
        differs = first_difference(prompt_ids, current.ids) if current is not None else None
        if current is None or differs is not None:
            why = None if current is None else (
                f"turn {len(self._turns)}'s prompt ({len(prompt_ids)} ids) does not extend the episode's "
                f"{len(current.ids)} ids: they differ at position {differs}")
            current = _SegmentLog(why)
            self._segments.append(current)
        start = len(current.ids)
        current.extend(prompt_ids[start:], 0)
        current.extend(sampled_ids, 1, logprobs)
        self.nbytes += (len(prompt_ids) - start + len(sampled_ids)) * BYTES_PER_TOKEN
        turn = Turn(len(self._segments) - 1, len(prompt_ids), len(sampled_ids), captured.model,
                    captured.finish_reason)
        self._turns.append(turn)
        return turn

    def note(self, text: str) -> None:
        """Record something the trainer must know about the episode (a turn not captured)."""
        self.notes.append(text)
        self.nbytes += len(text)

    def record(self) -> EpisodeRecord:
        """The episode as the trainer receives it."""
        model, version = (self.pin.model, self.pin.version) if self.pin is not None else (None, None)
        return EpisodeRecord(self.episode_id, model, version,
                             tuple(s.frozen() for s in self._segments), tuple(self._turns), tuple(self.notes))
