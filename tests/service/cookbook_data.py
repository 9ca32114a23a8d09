"""Offline stand-ins for what tinker-cookbook's minimal loops download: a tokenizer directory under the served
model's name, `HuggingFaceH4/no_robots` (chat SFT) and `openai/gsm8k` (`main`: question, answer), as local
directories the loops' own `get_tokenizer` and `datasets.load_dataset` read with the hub offline."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SERVED_NAME = "Qwen/Qwen3-4B-Instruct-2507"
"""A name in the cookbook's model table, served by titan_lora with SmolLM2-135M-Instruct's weights: its
renderer (`qwen3_instruct`, ChatML) is the chat format SmolLM2-Instruct was tuned on. With `role_colon` (a
Llama-3.2-1B name) the model boxed an answer in 17% of samples and got 0% right; with ChatML 1% right, which
is enough for the RL loop's groups to have a signal."""
GSM8K_CARD = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
---
"""


def write_cookbook_inputs(workdir: Path, hf_dir: Path, sft_jsonl: Path) -> None:
    """The tokenizer, the SFT conversations (from `sft_jsonl`'s prompt/completion rows) and easy sums in
    GSM8K's layout ("#### <answer>"), under `workdir`."""
    tokenizer = workdir / SERVED_NAME
    tokenizer.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf_dir / name, tokenizer / name)
    rows = [json.loads(line) for line in sft_jsonl.read_text().splitlines()]
    chats = [[{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}]
             for r in rows]
    robots = workdir / "HuggingFaceH4/no_robots/data"
    robots.mkdir(parents=True)
    pq.write_table(pa.table({"messages": chats[:-16]}), robots / "train-00000-of-00001.parquet")
    pq.write_table(pa.table({"messages": chats[-16:]}), robots / "test-00000-of-00001.parquet")
    rng = random.Random(0)
    gsm8k = workdir / "openai/gsm8k"
    (gsm8k / "main").mkdir(parents=True)
    (gsm8k / "README.md").write_text(GSM8K_CARD)
    for split, count in (("train", 256), ("test", 32)):
        pairs = [(rng.randint(1, 9), rng.randint(1, 9)) for _ in range(count)]
        pq.write_table(pa.table({"question": [f"What is {a} + {b}?" for a, b in pairs],
                                 "answer": [f"{a} + {b} = {a + b}\n#### {a + b}" for a, b in pairs]}),
                       gsm8k / "main" / f"{split}-00000-of-00001.parquet")
