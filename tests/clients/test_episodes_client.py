"""The trainer's episode helpers against a scripted engine client: the header, fetch (404 becomes
UnknownEpisode) and delete."""

from __future__ import annotations

from typing import Any

import pytest

from titan_lora.clients.episodes import delete_episode, episode_headers, fetch_episode, new_episode_id
from titan_lora.clients.http import HTTPStatusError
from titan_lora.transfer import protocol
from titan_lora.transfer.episodes import EpisodeRecord, UnknownEpisode

RECORD = EpisodeRecord("e1", "policy-v1", 1, (), ())


class Scripted:
    """Answers the episode routes as an engine holding RECORD would."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, dict]] = []

    def post(self, path: str, body: dict | None = None, timeout_s: float | None = None) -> Any:
        self.posts.append((path, body))
        if path == protocol.path(protocol.EPISODE):
            if body["episode_id"] != "e1":
                raise HTTPStatusError("... failed with HTTP 404: episode 'e2' was deleted", 404)
            return RECORD.to_json()
        return {"deleted": body["episode_id"] == "e1"}


def test_the_header_and_a_fresh_id() -> None:
    eid = new_episode_id()
    assert episode_headers(eid) == {"X-Titan-Episode": eid} and new_episode_id() != eid
    with pytest.raises(ValueError, match="episode id"):
        episode_headers("no spaces")


def test_fetch_and_delete_through_the_titan_routes() -> None:
    engine = Scripted()
    assert fetch_episode(engine, "e1") == RECORD
    with pytest.raises(UnknownEpisode, match="'e2' was deleted"):
        fetch_episode(engine, "e2")
    assert delete_episode(engine, "e1") and not delete_episode(engine, "e2")
    assert engine.posts[0] == ("/titan/episode", {"episode_id": "e1"})
    assert engine.posts[-1] == ("/titan/delete_episode", {"episode_id": "e2"})
