"""The episode record both sides share: ids, its JSON round trip and the per-turn views."""

from __future__ import annotations

import json

import pytest

from titan_lora.transfer.episodes import EpisodeRecord, Segment, Turn, UnknownEpisode, check_episode_id


def test_episode_ids() -> None:
    assert check_episode_id("0f3a-run:7.b_c") == "0f3a-run:7.b_c"
    for bad in ("", "a/b", "x" * 129, None, 3):
        with pytest.raises(ValueError, match="must be 1 to 128 of letters"):
            check_episode_id(bad)


def test_a_record_survives_json_and_reads_per_turn() -> None:
    record = EpisodeRecord(
        "e", "policy-v2", 2,
        (Segment((1, 2, 3, 4), (0, 0, 1, 1), (0.0, 0.0, -0.1, -0.2)),
         Segment((1, 9, 5), (0, 0, 1), (0.0, 0.0, -0.3), why_new="differ at position 1")),
        (Turn(0, 2, 2, "policy-v2", "stop"), Turn(1, 2, 1, "policy-v2", "length")), ("a note",))
    again = EpisodeRecord.from_json(json.loads(json.dumps(record.to_json())))
    assert again == record
    assert again.prompt_ids(0) == [1, 2] and again.sampled_ids(0) == [3, 4]
    assert again.prompt_ids(1) == [1, 9] and again.sampled_logprobs(1) == [-0.3]


def test_unknown_episode_prints_its_message_unquoted() -> None:
    assert str(UnknownEpisode("episode 'e' was deleted")) == "episode 'e' was deleted"
