"""The GRPO lengths a config must fit: the task's longest prompt plus `[grpo] max_new_tokens` tokens, in the
trainer's `[training] seq_len` and in the `[engine] max_model_len` of an engine titan_lora starts. Checked
when the config is read: too short a length otherwise fails after the engine started (a RoPE table of
seq_len rows, or the engine refusing the request)."""

from __future__ import annotations

from titan_lora.config import JobConfig, attached_urls
from titan_lora.rl.agent_task import is_agent_task
from titan_lora.rl.task import Task, task_prompt, train_and_heldout


def longest_prompt(tokenizer, task: Task, train_size: int, eval_size: int, seed: int) -> int:  # noqa: ANN001
    """The token count of the longest prompt among the task's training and held-out problems."""
    train, heldout = train_and_heldout(task, train_size, eval_size, seed)
    prompts = [task_prompt(tokenizer, task, p.question, p.system) for p in train + heldout]
    return max(len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"])


def check_prompt_lengths(job_config: JobConfig, task: Task | None, hf_dir: str) -> None:
    """Refuse a `[training] seq_len` or `[engine] max_model_len` shorter than the longest prompt plus
    `[grpo] max_new_tokens` (an agent task's episodes cut their sequences to seq_len themselves)."""
    grpo = job_config.grpo
    if not grpo.enabled or task is None or is_agent_task(task):
        return
    from transformers import AutoTokenizer

    longest = longest_prompt(AutoTokenizer.from_pretrained(hf_dir), task, grpo.train_size, grpo.eval_size, grpo.seed)
    need = longest + grpo.max_new_tokens
    limits = {"[training] seq_len": job_config.training.seq_len}
    if grpo.rollouts and not attached_urls(job_config.engine):  # the engine titan_lora starts
        limits["[engine] max_model_len"] = job_config.engine.max_model_len
    for key, limit in limits.items():
        if need > limit:
            raise ValueError(f"{key} = {limit} cannot hold the task's longest prompt ({longest} tokens) plus "
                             f"[grpo] max_new_tokens = {grpo.max_new_tokens}: raise {key.split()[-1]} to at "
                             f"least {need}, or lower max_new_tokens")
