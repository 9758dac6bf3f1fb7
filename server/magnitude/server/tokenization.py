"""Prompts to token ids: chat messages through the model's own chat template, or raw text; and
the character bound that refuses a prompt too long for the context before any of that work.

Works with a Hugging Face tokenizer or anything with the same small surface
(`encode`, `decode`, `apply_chat_template`, optionally `get_vocab`), such as the simulated
runner's byte tokenizer.
"""

from __future__ import annotations

from typing import Any

# For a tokenizer that cannot list its vocabulary: generous (SmolLM2's longest token is 81).
DEFAULT_MAX_CHARS_PER_TOKEN = 256


def longest_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters one token stands for: the longest vocabulary entry.

    An entry is never shorter than the text it decodes to (byte-level BPE spells one byte per
    character, SentencePiece's '▁' is the space, byte fallback '<0x41>' is longer than its byte),
    so a text of N characters needs at least N / this many tokens, unless the tokenizer's
    normalizer deletes characters (LLM tokenizers do not)."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return DEFAULT_MAX_CHARS_PER_TOKEN
    return max((len(token) for token in get_vocab()), default=1)


class PromptRenderer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.max_chars_per_token = longest_token_chars(tokenizer)

    def max_prompt_chars(self, max_model_len: int) -> int:
        """Characters above which a prompt cannot fit `max_model_len` tokens, whatever it says.
        Counted on the message texts before the chat template, which only adds text."""
        return max_model_len * self.max_chars_per_token

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
