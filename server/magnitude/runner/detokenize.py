"""Streaming text out of token ids: incremental detokenization that never splits a character.

`IncrementalDetokenizer.push(token_id)` returns only the new text, and never a partial character:
while the decoded tail ends in U+FFFD (a multi-byte UTF-8 character split across byte-level BPE
tokens) it returns "" and waits for the rest. Only a small window of tokens is re-decoded per push
(the prefix/read offsets of vLLM's detokenizer), so the cost per token does not grow with length.
A few prompt tokens can seed the window so the first word's leading space decodes as in context.
Stop strings are cut by the server's output processor (`magnitude.server.output_processor.StopMatcher`).
Tokenizer-only: no torch.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
_CONTEXT_TOKENS = 5  # tokens of left context kept so word boundaries (leading spaces) decode right


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text deltas."""

    def __init__(
        self, tokenizer: _Decoder, skip_special_tokens: bool = True, prompt_token_ids: list[int] | None = None
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_token_ids or [])[-_CONTEXT_TOKENS:]
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._num_context = len(context)
        self.text = ""  # everything emitted so far

    @property
    def token_ids(self) -> list[int]:
        """The generated tokens pushed so far (without the prompt context)."""
        return self._ids[self._num_context :]

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if new_text.endswith(REPLACEMENT_CHAR) or len(new_text) <= len(prefix_text):
            return ""  # an incomplete character (or nothing visible yet): wait for more bytes
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a stream: whatever is still pending (a truly invalid byte sequence shows as U+FFFD)."""
        if self._read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta
