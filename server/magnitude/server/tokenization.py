"""Prompts to token ids: chat messages through the model's own chat template, or raw text; and
the character bound that refuses a prompt too long for the context before any of that work.

Works with a Hugging Face tokenizer or anything with the same small surface
(`encode`, `decode`, `apply_chat_template`, optionally `get_vocab`), such as the simulated
runner's byte tokenizer.

Message fields beyond `role` and `content` (`name`, `tool_call_id`, `tool_calls`) reach the chat
template; a template that does not render one would drop it silently, so `unrendered_field`
finds such a field by rendering a probe message carrying a sentinel value once per (role, field)
and the server refuses the request naming it.
"""

from __future__ import annotations

from typing import Any

_SENTINEL = "magnitude-probe-7f3a"

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
        self._rendered: dict[tuple[str, str], bool] = {}
        self._renders_tools: bool | None = None

    def max_prompt_chars(self, max_model_len: int) -> int:
        """Characters above which a prompt cannot fit `max_model_len` tokens, whatever it says.
        Counted on the message texts before the chat template, which only adds text."""
        return max_model_len * self.max_chars_per_token

    def chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
             tools: list[dict[str, Any]] | None = None) -> list[int]:
        extra = {"tools": tools} if tools else {}
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  **extra)
        # The template already wrote the special tokens it wants.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def renders_tools(self) -> bool:
        """Whether the chat template has a tools block: it writes a probe tool's name when given
        `tools=` (else the server renders tools in its default format, `tools.py`)."""
        if self._renders_tools is None:
            probe = [{"type": "function", "function": {"name": _SENTINEL.replace("-", "_"), "description": "x",
                                                         "parameters": {"type": "object", "properties": {}}}}]
            try:
                text = self.tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                                          add_generation_prompt=True, tools=probe)
                self._renders_tools = _SENTINEL.replace("-", "_") in text
            except Exception:  # noqa: BLE001 - a template that cannot take tools has no tools block
                self._renders_tools = False
        return self._renders_tools

    def unrendered_field(self, messages: list[dict[str, Any]]) -> tuple[int, str] | None:
        """(index, field) of the first message field the chat template does not render, or None."""
        for i, m in enumerate(messages):
            for name in m.keys() - {"role", "content"}:
                if not self._renders(m["role"], name):
                    return i, name
        return None

    def _renders(self, role: str, name: str) -> bool:
        key = (role, name)
        if key not in self._rendered:
            probe: dict[str, Any] = {"role": role, "content": "x"}
            if name == "tool_calls":
                probe[name] = [{"id": _SENTINEL, "type": "function", "function": {"name": _SENTINEL, "arguments": {}}}]
            else:
                probe[name] = _SENTINEL
            # Templates may insist on a conversation shape (a user turn first, a call before its result).
            shapes = [[probe], [{"role": "user", "content": "x"}, probe]]
            if role == "tool":
                call = {"id": "x", "type": "function", "function": {"name": "x", "arguments": {}}}
                shapes.append([{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}, probe])
            self._rendered[key] = any(self._probe(shape) for shape in shapes)
        return self._rendered[key]

    def _probe(self, messages: list[dict[str, Any]]) -> bool:
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template refusing this shape renders nothing
            return False
        return _SENTINEL in text

    def text(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each id's vocabulary entry (vLLM's `token_strs`); the decoded text when the tokenizer has none."""
        convert = getattr(self.tokenizer, "convert_ids_to_tokens", None)
        if convert is not None:
            return [str(t) for t in convert(ids)]
        return [self.tokenizer.decode([i]) for i in ids]

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def check_ids(self, ids: list[int]) -> int | None:
        """Index of the first token id outside the vocabulary, or None."""
        vocab = self.vocab_size
        for i, t in enumerate(ids):
            if t >= vocab:
                return i
        return None
