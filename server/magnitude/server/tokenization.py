"""Prompts to token ids: chat messages through the model's own chat template, or raw text.

Works with a Hugging Face tokenizer or anything with the same small surface
(`encode`, `decode`, `apply_chat_template`), such as the simulated runner's byte tokenizer.
"""

from __future__ import annotations

from typing import Any


class PromptRenderer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # The template already wrote the special tokens it wants.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def text(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt, add_special_tokens=True))

    def check_ids(self, ids: list[int]) -> int | None:
        """Index of the first token id outside the vocabulary, or None."""
        vocab = len(self.tokenizer)
        for i, t in enumerate(ids):
            if t >= vocab:
                return i
        return None
