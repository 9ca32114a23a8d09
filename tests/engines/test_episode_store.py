"""The engine's episode store without an engine: the first turn pins the version, the bounds free the
least recently used episode (counted, and a late fetch says why), and limits come from the environment."""

from __future__ import annotations

import pytest

from titan_lora.engines.episode_log import BYTES_PER_TOKEN, CapturedTurn, Pin
from titan_lora.engines.episode_store import IDLE_S_ENV, MAX_EPISODES_ENV, EpisodeLimits, EpisodeStore
from titan_lora.transfer.episodes import UnknownEpisode

V1 = Pin("policy-v1", "policy", 1)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def turn(prompt: list[int], sampled: list[int], model: str = "policy-v1") -> CapturedTurn:
    return CapturedTurn(prompt, sampled, [-1.0] * len(sampled), model, "stop")


def test_the_first_turn_pins_the_episode_and_a_turn_on_another_version_is_noted_not_captured() -> None:
    store = EpisodeStore()
    store.add_turn("e", turn([1], [2]), V1)
    store.add_turn("e", turn([1, 2, 3], [4], "policy-v2"), Pin("policy-v2", "policy", 2))
    record = store.fetch("e")
    assert (record.model, record.version, len(record.turns)) == ("policy-v1", 1, 1)
    assert record.notes == ("response 2: served by 'policy-v2' while the episode runs on 'policy-v1': "
                            "not captured",)
    assert store.get("e").pin == V1


def test_fetch_and_delete() -> None:
    store = EpisodeStore()
    store.add_turn("e", turn([1], [2]), V1)
    store.note("e", "ValueError: no token ids")
    assert store.fetch("e").notes == ("response 2: ValueError: no token ids",)
    assert store.delete("e") and not store.delete("e")
    with pytest.raises(UnknownEpisode, match="'e' is no longer held: it was deleted"):
        store.fetch("e")
    with pytest.raises(UnknownEpisode, match="'other' is unknown to this engine"):
        store.fetch("other")
    assert store.stats()["live"] == 0 and store.stats()["bytes"] == 0 and store.deleted == 1


def test_an_abandoned_episode_is_freed_after_the_idle_bound_and_counted() -> None:
    clock = Clock()
    store = EpisodeStore(EpisodeLimits(idle_s=10), clock)
    store.add_turn("old", turn([1], [2]), V1)
    clock.now = 5
    store.add_turn("young", turn([1], [2]), V1)
    clock.now = 11
    assert store.get("young") is not None  # touched at 5 and now at 11
    with pytest.raises(UnknownEpisode, match="freed it, least recently used, when no turn for over 10 s"):
        store.fetch("old")
    assert store.stats()["freed"] == {"idle": 1} and store.stats()["live"] == 1


def test_the_count_and_byte_bounds_free_the_least_recently_used() -> None:
    store = EpisodeStore(EpisodeLimits(max_episodes=2))
    for name in ("a", "b"):
        store.add_turn(name, turn([1], [2]), V1)
    store.get("a")  # a turn starts on a: b is now the least recently used
    store.add_turn("c", turn([1], [2]), V1)
    assert store.get("b") is None and store.get("a") is not None
    assert store.freed == {"count": 1}

    small = EpisodeStore(EpisodeLimits(max_bytes=5 * BYTES_PER_TOKEN))
    small.add_turn("a", turn([1, 2], [3]), V1)
    small.add_turn("b", turn([1], [2]), V1)
    assert small.stats()["bytes"] == 5 * BYTES_PER_TOKEN and small.stats()["live"] == 2
    small.add_turn("b", turn([1, 2], [3]), V1)
    assert small.get("a") is None and small.freed == {"bytes": 1}
    assert small.stats()["bytes"] == 3 * BYTES_PER_TOKEN


def test_a_freed_episode_that_gets_another_turn_says_its_earlier_turns_are_gone() -> None:
    store = EpisodeStore(EpisodeLimits(max_episodes=1))
    store.add_turn("a", turn([1], [2]), V1)
    store.add_turn("b", turn([1], [2]), V1)
    store.add_turn("a", turn([1, 2, 3], [4]), V1)
    record = store.fetch("a")
    assert len(record.turns) == 1 and "its earlier turns are gone" in record.notes[0]
    assert "over 1 episodes held" in record.notes[0]


def test_limits_from_the_environment() -> None:
    assert EpisodeLimits.from_env({}) == EpisodeLimits()
    assert EpisodeLimits.from_env({MAX_EPISODES_ENV: "3", IDLE_S_ENV: "2.5"}) == EpisodeLimits(3, idle_s=2.5)
    with pytest.raises(ValueError, match="must be numbers"):
        EpisodeLimits.from_env({MAX_EPISODES_ENV: "many"})
    with pytest.raises(ValueError, match="must be positive"):
        EpisodeLimits.from_env({IDLE_S_ENV: "0"})
