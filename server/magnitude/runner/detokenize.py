"""Incremental detokenization: token ids in, text deltas out, never splitting a multi-byte character.

Tokenizer-only (no torch). Follows the prefix/read-offset scheme vLLM and TGI use: decode a short
window of recent tokens with and without the newest ones and emit the difference, holding text
back while it ends in an incomplete UTF-8 sequence (decoded as U+FFFD). Decoding a window rather
than single tokens keeps tokenizers that merge spaces across tokens (SentencePiece) correct.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # start of the context window decoded for comparison
        self._read_offset = 0  # tokens before this have been emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly empty)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.token_ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            delta = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.token_ids)
            return delta
        return ""

    def flush(self) -> str:
        """At the end of the stream: whatever is still held back (an incomplete character stays U+FFFD)."""
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.token_ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self.token_ids)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
