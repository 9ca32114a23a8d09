"""The two loops behind `SampleSource`: the sync loop's data order and stale drops, the async loop's producer
started at the checkpoint's data position, and a sync run refusing an async run's position."""

from __future__ import annotations

import pytest

from titan_lora.config import GRPO, GRPO_LOOPS
from titan_lora.rl.producer import BusyClock
from titan_lora.rl.rollout import Sample
from titan_lora.rl.sample_source import LOOPS, Draws, fresh_samples, sample_source
from titan_lora.sync.versions import AdapterVersions, Lease

B = 2  # prompts per step


def _sample(version: int, group: int = 0) -> Sample:
    return Sample([1, 2], [3], [-0.5], 1.0, 0.5, version, "3", group=group)


def _never(index: int, lease: Lease) -> list[Sample]:
    raise AssertionError("the sync loop draws no single group")


def test_fresh_samples_keeps_versions_within_the_staleness_window() -> None:
    samples = [_sample(v) for v in (2, 3, 4, 5, 5)]
    assert [s.version for s in fresh_samples(samples, current_version=5, max_staleness=1)] == [4, 5, 5]
    assert [s.version for s in fresh_samples(samples, current_version=5, max_staleness=0)] == [5, 5]
    assert len(fresh_samples(samples, current_version=5, max_staleness=3)) == 5
    assert fresh_samples([], current_version=5, max_staleness=1) == []


def test_all_stale_samples_name_the_fix() -> None:
    with pytest.raises(RuntimeError) as err:
        fresh_samples([_sample(1), _sample(1)], current_version=7, max_staleness=1)
    assert str(err.value) == ("every one of the 2 samples is stale: they come from adapter versions [1], the trainer "
                              "is at version 7 and [grpo] max_staleness = 1; the engine is not receiving new adapter "
                              "versions (check [weight_sync] and the engine's log)")


def test_every_loop_the_config_accepts_has_a_source() -> None:
    assert set(LOOPS) == set(GRPO_LOOPS)


def test_the_sync_loop_numbers_a_steps_groups_in_data_order_and_counts_what_it_drops() -> None:
    drawn: list[int] = []

    def draw_step(step: int) -> list[Sample]:  # the step's groups, numbered by prompt index in the step
        drawn.append(step)
        return [_sample(step - 1, group=0), _sample(step - 1, group=0), _sample(step - 3, group=1)]

    clock = BusyClock()
    source = sample_source(GRPO(prompts_per_step=B, max_staleness=1))(Draws(draw_step, _never, None, clock))
    source.start(3)
    samples = source.take(4)
    assert drawn == [4] and source.taken == [6, 7], "step 4's groups are data indices 3 x B + 0, 1"
    assert [(s.group, s.trained_at) for s in samples] == [(6, 4), (6, 4), (7, 4)]
    assert clock.lap()[2] == 3, "the generated tokens go on the clock"
    assert source.trainable(samples, current=3) == samples[:2] and source.dropped() == 1
    source.trainable(samples, current=3)
    assert source.dropped() == 2, "the count accumulates over steps"
    assert source.progress_fields({}) == {} and source.metrics() == {} and source.data_state() is None


def test_the_async_loop_starts_its_producer_at_the_checkpoints_data_position() -> None:
    versions = AdapterVersions("policy", keep_versions=3)  # nothing published: admission waits
    saved = {"next_group": 6, "trained_ahead": [7, 9], "per_step": B}
    source = sample_source(GRPO(loop="async", prompts_per_step=B), saved)(Draws(lambda step: [], _never, versions,
                                                                                BusyClock()))
    assert source.data_state() is None and source.taken == [], "nothing to keep before it starts"
    source.start(3)
    try:
        assert source.data_state() == saved
        assert source.progress_fields({"rl/staleness_mean": 0.5, "rl/staleness_max": 1.0}) == {"stale": "0.50/1"}
    finally:
        source.close()


def test_the_async_loop_starts_at_the_step_without_a_saved_position_and_draws_nothing_off_rank_0() -> None:
    cfg = GRPO(loop="async", prompts_per_step=B)
    source = sample_source(cfg)(Draws(lambda step: [], _never, AdapterVersions("policy", keep_versions=3), BusyClock()))
    source.start(3)
    try:
        assert source.data_state() == {"next_group": 6, "trained_ahead": [], "per_step": B}
    finally:
        source.close()
    elsewhere = sample_source(cfg)(Draws(lambda step: [], _never, None, BusyClock()))
    elsewhere.start(3)
    assert elsewhere.data_state() is None and elsewhere.metrics() == {} and elsewhere.dropped() == 0


def test_the_async_loop_refuses_a_sample_older_than_max_staleness_as_a_bug() -> None:
    source = sample_source(GRPO(loop="async", max_staleness=1))(Draws(lambda step: [], _never, None, BusyClock()))
    assert source.trainable([_sample(3)], current=4) == [_sample(3)]
    with pytest.raises(RuntimeError, match=r"^the async loop handed step 5 samples of versions \[2\], older than "):
        source.trainable([_sample(2)], current=4)


def test_a_sync_run_refuses_the_data_position_an_async_run_saved() -> None:
    with pytest.raises(ValueError) as err:
        sample_source(GRPO(loop="sync"), {"next_group": 6, "trained_ahead": [7, 9], "per_step": B})
    assert str(err.value) == (
        '[grpo] loop = "sync" cannot resume this checkpoint: an async-loop run wrote it, with groups below 6 and 2 '
        "above trained, which no step-based position matches (groups would be trained twice or skipped); resume "
        'with [grpo] loop = "async", or start a new run in another [job] dump_folder')
    assert sample_source(GRPO(loop="sync"), None) is not None, "a checkpoint without a data position resumes"
