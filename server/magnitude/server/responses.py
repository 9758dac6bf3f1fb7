"""OpenAI response bodies and SSE chunks for chat and text completions.

One `ResponseBuilder` per request knows its id, kind (chat or text), model and creation time and
turns engine events into OpenAI JSON: full responses, stream chunks, progress chunks (empty
`choices` plus a `progress` object, a Magnitude extension) and the usage chunk. Per-request
timing (queue time, TTFT, mean ITL, e2e) travels as the extension field `timing`.

A chat answer with tools or a response format is shaped by its `AnswerPlan` (`answer.py`): tool
calls become `tool_calls` (streamed as one delta per call once the answer is complete; in `auto`
mode the content before the first call streams as it comes), and the output contract's verdict
goes to `timing.output_contract` and to `on_contract` (the metric).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from magnitude.server.answer import Answer, AnswerPlan
from magnitude.server.async_engine import Delta, Finished, Progress
from magnitude.server.output_processor import TokenLogprob
from magnitude.server.tools import AutoCallFilter


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
    index: int = 0  # the choice this builder speaks for (n > 1: one builder per choice)
    plan: AnswerPlan = field(default_factory=AnswerPlan)
    on_contract: Callable[[str], None] | None = None  # counts each contract verdict once
    created: int = field(default_factory=lambda: int(time.time()))
    _text_offset: int = 0
    _streamed_text: list[str] = field(default_factory=list)
    _auto_filter: AutoCallFilter = field(default_factory=AutoCallFilter)

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
            self._chunk_object, [{"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
        )

    def progress_chunk(self, ev: Progress) -> dict[str, Any]:
        chunk = self._envelope(self._chunk_object, [])
        chunk["progress"] = ev.as_dict()
        return chunk

    def delta_chunk(self, ev: Delta) -> dict[str, Any] | None:
        """The chunk for a text delta; None when a tool-call answer holds the text back."""
        self._streamed_text.append(ev.text)
        text = ev.text
        if self.plan.parses_calls:
            assert self.plan.tools is not None
            text = self._auto_filter.feed(ev.text) if self.plan.tools.mode == "auto" else ""
            if not text and not self.want_logprobs:
                return None
        choice: dict[str, Any] = {"index": self.index, "logprobs": self.logprobs(ev.logprobs), "finish_reason": None}
        if self.chat:
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        return self._envelope(self._chunk_object, [choice])

    def finish_chunks(self, ev: Finished) -> list[dict[str, Any]]:
        """The answer's last chunks: held-back content or the tool calls, then the finish."""
        answer = self._answer("".join(self._streamed_text), ev)
        chunks = []
        if self.plan.parses_calls and not answer.tool_calls:
            rest = answer.content if self.plan.tools and self.plan.tools.mode != "auto" else self._auto_filter.rest()
            if rest:
                chunks.append(self._envelope(self._chunk_object, [
                    {"index": self.index, "delta": {"content": rest}, "logprobs": None, "finish_reason": None}]))
        if answer.tool_calls:
            calls = [{"index": i, **c} for i, c in enumerate(answer.tool_calls)]
            chunks.append(self._envelope(self._chunk_object, [
                {"index": self.index, "delta": {"tool_calls": calls}, "logprobs": None, "finish_reason": None}]))
        choice: dict[str, Any] = {"index": self.index, "logprobs": None, "finish_reason": answer.finish_reason}
        if self.chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        chunk = self._envelope(self._chunk_object, [choice])
        chunk["timing"] = ev.timing
        chunks.append(chunk)
        return chunks

    def _answer(self, text: str, fin: Finished) -> Answer:
        """The plan's reading of the finished text; records the contract verdict (once)."""
        answer = self.plan.finish(text, fin.finish_reason)
        if answer.contract is not None and "output_contract" not in fin.timing:
            fin.timing["output_contract"] = answer.contract  # type: ignore[assignment]
            if self.on_contract is not None:
                self.on_contract(answer.contract)
        return answer

    def usage_chunk(self, ends: list[Finished]) -> dict[str, Any]:
        """The last chunk with usage: over all choices (the prompt counted once); timing: choice 0's."""
        chunk = self._envelope(self._chunk_object, [])
        chunk["usage"] = usage(ends)
        chunk["timing"] = ends[0].timing
        return chunk

    # -- full response -----------------------------------------------------------------------------
    def full(self, deltas: list[Delta], fin: Finished) -> dict[str, Any]:
        text = "".join(d.text for d in deltas)
        lps = [lp for d in deltas for lp in d.logprobs]
        if self.chat:
            answer = self._answer(text, fin)
            message: dict[str, Any] = {"role": "assistant", "content": answer.content}
            if answer.tool_calls:
                message["tool_calls"] = answer.tool_calls
            choice = {
                "index": self.index,
                "message": message,
                "logprobs": self.logprobs(lps),
                "finish_reason": answer.finish_reason,
            }
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": self.index, "text": text, "logprobs": self.logprobs(lps), "finish_reason": fin.finish_reason}
            body = self._envelope("text_completion", [choice])
        body["usage"] = usage([fin])
        body["timing"] = fin.timing
        return body


def usage(ends: list[Finished]) -> dict[str, Any]:
    """OpenAI's usage over a request's choices: the prompt once, every choice's completion;
    `cached_tokens` are the prompt tokens the prefix cache served choice 0."""
    first = ends[0]
    completion = sum(f.completion_tokens for f in ends)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": int(first.timing.get("cached_prompt_tokens") or 0)},
    }


def merge_choices(bodies: list[dict[str, Any]], ends: list[Finished]) -> dict[str, Any]:
    """One response from each choice's full body: all choices, usage over all, choice 0's timing
    (each choice's own timing is in its request timeline)."""
    body = bodies[0]
    if len(bodies) > 1:
        body["choices"] = [b["choices"][0] for b in bodies]
        body["usage"] = usage(ends)
    return body
