"""The trainer's side of episode capture (`transfer.episodes`): the header that makes a chat completion a
turn of an episode, and fetching and deleting the record the engine kept.

    eid = new_episode_id()
    reply = api.chat.completions.create(model="policy", messages=..., extra_headers=episode_headers(eid))
    ...  # more turns, same header; the engine runs them all on reply.model
    record = fetch_episode(titan_client, eid); delete_episode(titan_client, eid)
"""

from __future__ import annotations

import uuid

from titan_lora.clients.http import HTTPStatusError, JsonClient
from titan_lora.transfer import protocol
from titan_lora.transfer.episodes import EpisodeRecord, UnknownEpisode, check_episode_id


def new_episode_id() -> str:
    """A fresh episode id."""
    return uuid.uuid4().hex


def episode_headers(episode_id: str) -> dict[str, str]:
    """The headers (openai `extra_headers=`) that make a chat completion a turn of `episode_id`."""
    return {protocol.EPISODE_HEADER: check_episode_id(episode_id)}


def fetch_episode(client: JsonClient, episode_id: str) -> EpisodeRecord:
    """The engine's record of `episode_id`; UnknownEpisode (with the engine's reason) when it holds none."""
    try:
        reply = client.post(protocol.path(protocol.EPISODE), {"episode_id": check_episode_id(episode_id)})
    except HTTPStatusError as err:
        if err.status == 404:
            raise UnknownEpisode(str(err)) from None
        raise
    return EpisodeRecord.from_json(reply)


def delete_episode(client: JsonClient, episode_id: str) -> bool:
    """Drop `episode_id` on the engine; whether it held it."""
    return bool(client.post(protocol.path(protocol.DELETE_EPISODE),
                            {"episode_id": check_episode_id(episode_id)})["deleted"])
