"""An agent episode as the engine captured it: the records both sides agree on (`protocol.EPISODE`).

A client names an episode with the `protocol.EPISODE_HEADER` header on `/v1/chat/completions`; the
engine appends each turn: the prompt ids it rendered, the ids it sampled and their log-probs. The
episode is one token stream per segment: a turn whose prompt extends the segment's ids so far appends
the new context tokens (mask 0: template, tool and user tokens) and its sampled tokens (mask 1); a turn
whose prompt does not (an edited history, a template that drops earlier turns) starts a new segment
with its whole prompt, and the segment says why. Nothing is ever re-tokenized.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

_EPISODE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class UnknownEpisode(KeyError):
    """The engine holds no episode of that id (never captured, deleted, or freed by its bounds)."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0]) if self.args else ""


def check_episode_id(value: Any) -> str:
    """`value` when it is a usable episode id, else ValueError naming the rule."""
    if not isinstance(value, str) or not _EPISODE_ID.fullmatch(value):
        raise ValueError(f"episode id {value!r} must be 1 to 128 of letters, digits, '.', '_', ':' and '-' "
                         "(a uuid4 hex is a good one)")
    return value


@dataclasses.dataclass(frozen=True)
class Segment:
    """One exact token stream of an episode: ids, 1 where the policy sampled the id, and the engine's
    log-prob of each sampled id (0.0 for context ids)."""

    ids: tuple[int, ...]
    mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    why_new: str | None = None
    """Why this segment does not continue the previous one (None for the first)."""


@dataclasses.dataclass(frozen=True)
class Turn:
    """Where one turn sits in its segment: its prompt is `ids[:prompt_len]`, its sampled ids follow."""

    segment: int
    prompt_len: int
    sampled_len: int
    model: str
    """The served model name of the turn (the pinned adapter version)."""
    finish_reason: str | None


@dataclasses.dataclass(frozen=True)
class EpisodeRecord:
    """A captured episode: its segments, its turns, the version it is pinned to, and any turn that could
    not be captured (`notes`)."""

    episode_id: str
    model: str | None
    """The served model name every turn ran on (the first turn's), None before a turn was captured."""
    version: int | None
    """The adapter version of `model`; None for the base model or before a turn."""
    segments: tuple[Segment, ...]
    turns: tuple[Turn, ...]
    notes: tuple[str, ...] = ()

    def prompt_ids(self, turn: int) -> list[int]:
        """The prompt ids the engine rendered for `turn`."""
        t = self.turns[turn]
        return list(self.segments[t.segment].ids[:t.prompt_len])

    def sampled_ids(self, turn: int) -> list[int]:
        """The ids the engine sampled in `turn`."""
        t = self.turns[turn]
        return list(self.segments[t.segment].ids[t.prompt_len:t.prompt_len + t.sampled_len])

    def sampled_logprobs(self, turn: int) -> list[float]:
        """The engine's log-probs of the ids sampled in `turn`."""
        t = self.turns[turn]
        return list(self.segments[t.segment].logprobs[t.prompt_len:t.prompt_len + t.sampled_len])

    def to_json(self) -> dict[str, Any]:
        """The record as the EPISODE route answers it."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EpisodeRecord:
        """The record an EPISODE reply carries."""
        segments = tuple(Segment(tuple(s["ids"]), tuple(s["mask"]), tuple(s["logprobs"]), s.get("why_new"))
                         for s in data["segments"])
        return cls(data["episode_id"], data["model"], data["version"], segments,
                   tuple(Turn(**t) for t in data["turns"]), tuple(data.get("notes", ())))
