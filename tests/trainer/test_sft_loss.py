"""The SFT loss mask and loss, exactly: hand-derived tokens, labels and mask through the SFT data path."""

from __future__ import annotations

import json
import math

import pytest
import torch

from titan_lora.trainer.sft import masked_token_nll_sum
from titan_lora.trainer.sft_data import SFTData, collate, encode

PAD = 0


class CharTokenizer:
    """One token per character; the chat template wraps the question's first word as `<word>`."""

    eos_token = "$"
    pad_token_id = None
    eos_token_id = ord("$")

    def apply_chat_template(self, messages: list, tokenize: bool, add_generation_prompt: bool) -> str:
        return "<" + messages[0]["content"].split(" ")[0] + ">"

    def __call__(self, text: str, add_special_tokens: bool) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}


def _ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_encode_marks_where_the_completion_starts() -> None:
    ids, start = encode(CharTokenizer(), "ab", "c", seq_len=64)
    assert ids == _ids("<ab>c$") and start == 4
    ids, start = encode(CharTokenizer(), "ab", "cdef", seq_len=5)
    assert ids == _ids("<ab>cd"), "truncated to seq_len + 1 tokens"


def test_collate_masks_every_completion_label_and_nothing_else() -> None:
    tok = CharTokenizer()
    batch = collate([encode(tok, "ab", "c", 64), encode(tok, "a", "de", 64), encode(tok, "abc", "d", 64)],
                    pad_id=ord("$"))
    # Hand-derived. Row 0: <ab>c$ -> inputs <ab>c, labels ab>c$; the completion labels c, $ sit at 3, 4.
    assert batch.tokens.tolist() == [_ids("<ab>c$"), _ids("<a>de$"), _ids("<abc>d")]
    assert batch.labels.tolist() == [_ids("ab>c$$"), _ids("a>de$$"), _ids("abc>d$")]
    assert batch.mask.tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1]]


def test_sft_data_batches_carry_the_exact_mask(tmp_path) -> None:
    path = tmp_path / "pairs.jsonl"
    pairs = [("ab", "c"), ("x", "yz")]
    path.write_text("\n".join(json.dumps({"prompt": p, "completion": c}) for p, c in pairs))
    data = SFTData(CharTokenizer(), str(path), seq_len=64, global_batch=2, seed=0)
    b = data.local_batch(step=1, dp_rank=0, dp_size=1)
    rows = {tuple(r.tolist()): m.tolist() for r, m in zip(b.tokens, b.mask)}
    assert rows == {tuple(_ids("<ab>c")): [0, 0, 0, 1, 1], tuple(_ids("<x>yz")): [0, 0, 1, 1, 1]}
    halves = [data.local_batch(1, r, 2) for r in range(2)]
    assert torch.equal(torch.cat([h.mask for h in halves]), b.mask), "DP ranks split the same rows"


def test_masked_token_nll_sum_is_the_sum_of_hand_computed_nll() -> None:
    vocab = 5
    labels = torch.tensor([[1, 2, 3], [4, 0, 2]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # The label's logit is `boost`, the others 0: -log p(label) = -log(e^b / (e^b + vocab - 1)).
    boost = torch.tensor([[9.0, 1.0, 2.0], [-1.0, 7.0, 3.0]])
    logits = torch.zeros(2, 3, vocab)
    logits.scatter_(-1, labels[..., None], boost[..., None])

    def nll(b: float) -> float:
        return -(b - math.log(math.exp(b) + vocab - 1))

    want = nll(1.0) + nll(2.0) + nll(-1.0)
    assert masked_token_nll_sum(logits, labels, mask).item() == pytest.approx(want, rel=1e-6)
