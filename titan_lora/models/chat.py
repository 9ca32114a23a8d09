"""Chat-template handling, in one place: every prompt the trainer or the engine sees is rendered here."""

from __future__ import annotations


def chat_prompt(tokenizer, user: str, system: str = "") -> str:  # noqa: ANN001
    """`user` as one user turn (after a `system` turn, when given) in the tokenizer's chat template,
    ending where the assistant answers."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
