"""The SFT smoke job's data: chat-formatted prompt/completion pairs with a completion-only loss mask."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import torch

from titan_lora.models.chat import chat_prompt


@dataclasses.dataclass
class Batch:
    """Token ids, next-token labels and a mask that is 1 on completion tokens only."""

    tokens: torch.Tensor  # [B, T]
    labels: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] float


def global_batch_size(training, dp_size: int) -> int:  # noqa: ANN001 (the [training] section)
    """The SFT global batch: `[training] global_batch_size`, or when it is <= 0 local_batch_size x the DP size."""
    return training.global_batch_size if training.global_batch_size > 0 else training.local_batch_size * dp_size


def load_pairs(path: str | Path) -> list[tuple[str, str]]:
    """(prompt, completion) pairs from a JSONL file with "prompt" and "completion" keys."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"[data] path = {str(path)!r} does not exist")
    pairs = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        row = json.loads(line)
        if "prompt" not in row or "completion" not in row:
            raise ValueError(f"{path}:{i}: each line needs \"prompt\" and \"completion\" keys")
        pairs.append((row["prompt"], row["completion"]))
    return pairs


def encode(tokenizer, prompt: str, completion: str, seq_len: int) -> tuple[list[int], int]:  # noqa: ANN001
    """Token ids of the chat-formatted pair and the index where the completion starts."""
    prompt_ids = tokenizer(chat_prompt(tokenizer, prompt), add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(completion + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    ids = (prompt_ids + completion_ids)[: seq_len + 1]
    return ids, len(prompt_ids)


def collate(rows: list[tuple[list[int], int]], pad_id: int) -> Batch:
    """Right-pad a list of encoded rows into a Batch."""
    width = max(len(ids) for ids, _ in rows) - 1
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width))
    for r, (ids, start) in enumerate(rows):
        n = len(ids) - 1
        tokens[r, :n] = torch.tensor(ids[:-1])
        labels[r, :n] = torch.tensor(ids[1:])
        mask[r, max(start - 1, 0) : n] = 1.0  # predict the completion tokens (and EOS)
    return Batch(tokens, labels, mask)


class SFTData:
    """Deterministic global batches, split across data-parallel ranks; resumable by step."""

    def __init__(self, tokenizer, path: str, seq_len: int, global_batch: int, seed: int) -> None:  # noqa: ANN001
        self.rows = [encode(tokenizer, p, c, seq_len) for p, c in load_pairs(path)]
        if global_batch > len(self.rows):
            raise ValueError(f"global batch {global_batch} exceeds the {len(self.rows)} examples in the data")
        self.global_batch = global_batch
        self.seed = seed
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def global_batch_at(self, step: int) -> list[tuple[list[int], int]]:
        """The rows of global batch `step` (1-based), from a per-epoch seeded shuffle."""
        per_epoch = len(self.rows) // self.global_batch
        epoch, index = divmod(step - 1, per_epoch)
        order = list(range(len(self.rows)))
        random.Random(self.seed + epoch).shuffle(order)
        chosen = order[index * self.global_batch : (index + 1) * self.global_batch]
        return [self.rows[i] for i in chosen]

    def local_batch(self, step: int, dp_rank: int, dp_size: int) -> Batch:
        """This rank's share of global batch `step`, padded to the global batch's width."""
        rows = self.global_batch_at(step)
        if len(rows) % dp_size:
            raise ValueError(f"global batch {len(rows)} is not divisible by {dp_size} data-parallel ranks")
        full = collate(rows, self.pad_id)  # same width on every rank
        share = len(rows) // dp_size
        sl = slice(dp_rank * share, (dp_rank + 1) * share)
        return Batch(full.tokens[sl], full.labels[sl], full.mask[sl])
