"""OpenAI response bodies and SSE chunks for chat and text completions.

One `ResponseBuilder` per request knows its id, kind (chat or text), model and creation time and
turns engine events into OpenAI JSON: full responses, stream chunks, progress chunks (empty
`choices` plus a `progress` object, a Magnitude extension) and the usage chunk. Per-request
timing (queue time, TTFT, mean ITL, e2e) travels as the extension field `timing`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from magnitude.server.async_engine import Delta, Finished, Progress
from magnitude.server.output_processor import TokenLogprob


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"data: {payload}\n\n"


SSE_DONE = sse("[DONE]")


@dataclass
class ResponseBuilder:
    request_id: str
    chat: bool
    model: str
    want_logprobs: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    _text_offset: int = 0

    @property
    def id(self) -> str:
        suffix = self.request_id.split("-", 1)[-1]
        return ("chatcmpl-" if self.chat else "cmpl-") + suffix

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    # -- logprobs ----------------------------------------------------------------------------------
    def _chat_logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any]:
        return {
            "content": [
                {
                    "token": lp.token,
                    "logprob": lp.logprob,
                    "bytes": lp.bytes,
                    "top_logprobs": [{"token": t, "logprob": v, "bytes": b} for t, v, b in lp.top],
                }
                for lp in lps
            ]
        }

    def _text_logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any]:
        offsets = []
        for lp in lps:
            offsets.append(self._text_offset)
            self._text_offset += len(lp.token)
        return {
            "tokens": [lp.token for lp in lps],
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{t: v for t, v, _ in lp.top} for lp in lps],
            "text_offset": offsets,
        }

    def logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        return self._chat_logprobs(lps) if self.chat else self._text_logprobs(lps)

    # -- stream chunks -----------------------------------------------------------------------------
    def role_chunk(self) -> dict[str, Any]:
        return self._envelope(
            self._chunk_object, [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
        )

    def progress_chunk(self, ev: Progress) -> dict[str, Any]:
        chunk = self._envelope(self._chunk_object, [])
        chunk["progress"] = ev.as_dict()
        return chunk

    def delta_chunk(self, ev: Delta) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": self.logprobs(ev.logprobs), "finish_reason": None}
        if self.chat:
            choice["delta"] = {"content": ev.text}
        else:
            choice["text"] = ev.text
        return self._envelope(self._chunk_object, [choice])

    def finish_chunk(self, ev: Finished) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": ev.finish_reason}
        if self.chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        chunk = self._envelope(self._chunk_object, [choice])
        chunk["timing"] = ev.timing
        return chunk

    def usage_chunk(self, ev: Finished) -> dict[str, Any]:
        chunk = self._envelope(self._chunk_object, [])
        chunk["usage"] = usage(ev)
        chunk["timing"] = ev.timing
        return chunk

    # -- full response -----------------------------------------------------------------------------
    def full(self, deltas: list[Delta], fin: Finished) -> dict[str, Any]:
        text = "".join(d.text for d in deltas)
        lps = [lp for d in deltas for lp in d.logprobs]
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": self.logprobs(lps),
                "finish_reason": fin.finish_reason,
            }
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": self.logprobs(lps), "finish_reason": fin.finish_reason}
            body = self._envelope("text_completion", [choice])
        body["usage"] = usage(fin)
        body["timing"] = fin.timing
        return body


def usage(fin: Finished) -> dict[str, int]:
    return {
        "prompt_tokens": fin.prompt_tokens,
        "completion_tokens": fin.completion_tokens,
        "total_tokens": fin.prompt_tokens + fin.completion_tokens,
    }
