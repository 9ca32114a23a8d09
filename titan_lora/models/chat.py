"""Chat-template handling, in one place: every prompt the trainer or the engine sees is rendered here."""

from __future__ import annotations


def chat_prompt(tokenizer, user: str) -> str:  # noqa: ANN001
    """`user` as one user turn in the tokenizer's chat template, ending where the assistant answers."""
    messages = [{"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
