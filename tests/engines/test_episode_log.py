"""An episode's token stream without an engine: turns that extend it append context (mask 0) and
sampled ids (mask 1); a turn that does not starts a new segment that says where they differ."""

from __future__ import annotations

import pytest

from titan_lora.engines.episode_log import BYTES_PER_TOKEN, CapturedTurn, EpisodeLog, first_difference


def turn(prompt: list[int], sampled: list[int], model: str = "policy-v1") -> CapturedTurn:
    return CapturedTurn(prompt, sampled, [-0.5 - i for i in range(len(sampled))], model, "stop")


def test_turns_that_extend_the_stream_make_one_segment_with_the_sampled_ids_masked_in() -> None:
    log = EpisodeLog("e1")
    log.append(turn([1, 2, 3], [10, 11]))
    log.append(turn([1, 2, 3, 10, 11, 4, 5], [12]))  # tool tokens 4, 5 between the turns
    log.append(turn([1, 2, 3, 10, 11, 4, 5, 12], [13, 14]))  # no new context at all
    record = log.record()
    (segment,) = record.segments
    assert segment.ids == (1, 2, 3, 10, 11, 4, 5, 12, 13, 14)
    assert segment.mask == (0, 0, 0, 1, 1, 0, 0, 1, 1, 1)
    assert segment.logprobs == (0, 0, 0, -0.5, -1.5, 0, 0, -0.5, -0.5, -1.5)
    assert segment.why_new is None
    assert record.prompt_ids(1) == [1, 2, 3, 10, 11, 4, 5] and record.sampled_ids(1) == [12]
    assert record.sampled_logprobs(2) == [-0.5, -1.5]
    assert [t.segment for t in record.turns] == [0, 0, 0]
    assert log.nbytes == 10 * BYTES_PER_TOKEN


@pytest.mark.parametrize(("prompt", "at"), [
    ([1, 2, 9, 10, 11, 4], 2),  # an edited history
    ([1, 2, 3, 10], 4),  # a template that dropped the last sampled id: shorter than the stream
    ([1, 2, 3, 10, 99, 4], 4),  # the sampled text re-tokenized differently
])
def test_a_prompt_that_does_not_extend_the_stream_starts_a_new_segment(prompt: list[int], at: int) -> None:
    log = EpisodeLog("e2")
    log.append(turn([1, 2, 3], [10, 11]))
    log.append(turn(prompt, [20]))
    record = log.record()
    assert len(record.segments) == 2
    second = record.segments[1]
    assert second.ids == (*prompt, 20) and second.mask == (0,) * len(prompt) + (1,)
    assert f"differ at position {at}" in second.why_new and "turn 1's prompt" in second.why_new
    assert record.prompt_ids(1) == prompt and record.sampled_ids(1) == [20]
    assert record.segments[0].ids == (1, 2, 3, 10, 11), "the first segment is kept as it was"


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2]) is None
    assert first_difference([1, 2], [1, 2]) is None
    assert first_difference([1], [1, 2]) == 1
    assert first_difference([1, 3], [1, 2]) == 1


def test_a_turn_whose_log_probs_do_not_match_its_ids_is_refused() -> None:
    with pytest.raises(ValueError, match="2 sampled ids but 1 log-probs"):
        EpisodeLog("e3").append(CapturedTurn([1], [2, 3], [-1.0], "m", None))


def test_notes_count_toward_the_bytes_held() -> None:
    log = EpisodeLog("e4")
    log.note("abc")
    assert log.nbytes == 3 and log.record().notes == ("abc",) and log.record().model is None
