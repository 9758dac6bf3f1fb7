"""OpenAI wire models: what `/v1/completions` and `/v1/chat/completions` accept and return.

Requests are validated here (types, ranges, the Magnitude extensions `priority_class`,
`deadline_ms`, `ignore_eos`, `top_k`, `stream_options.include_progress`); checks that need the
engine (known model, known priority class, context length) live in `app.py`. Unknown request
fields are ignored, as OpenAI-compatible servers do, so newer clients keep working. Responses
are built as plain dicts by `responses.py`; only their stable shapes are described here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP_STRINGS = 8
MAX_STOP_LENGTH = 256
MAX_TOKENS_LIMIT = 1_000_000


class _Lenient(BaseModel):
    """Unknown fields are ignored (forward compatibility with newer OpenAI clients)."""

    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Lenient):
    include_usage: bool = False
    include_progress: bool = Field(
        default=False, description="Magnitude extension: progress chunks (loading, queued, prefill, generating)."
    )


class _SamplingRequest(_Lenient):
    """Fields shared by chat and text completions."""

    model: str = Field(min_length=1, max_length=512)
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=1_000_000, description="Extension: 0 disables top-k.")
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=253)
    presence_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    frequency_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    # Magnitude extensions (a stock client sends them through `extra_body`).
    priority_class: str | None = Field(default=None, min_length=1, max_length=63)
    deadline_ms: float | None = Field(default=None, gt=0.0, le=86_400_000.0)
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        for s in stops:
            if not s or len(s) > MAX_STOP_LENGTH:
                raise ValueError(f"each stop string must be 1..{MAX_STOP_LENGTH} characters")
        return stops

    @model_validator(mode="after")
    def _check_stream_options(self) -> "_SamplingRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return self.stop if isinstance(self.stop, list) else []

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def include_progress(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_progress)


class TextPart(_Lenient):
    type: Literal["text"]
    text: str = Field(max_length=4_000_000)


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str, Field(max_length=4_000_000)] | list[TextPart] | None = None
    name: str | None = Field(default=None, max_length=256)

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    @property
    def num_chars(self) -> int:
        if isinstance(self.content, list):
            return sum(len(p.text) for p in self.content)
        return len(self.content or "")


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def prompt_chars(self) -> int:
        """Characters of the message texts: the chat template only adds to them."""
        return sum(m.num_chars for m in self.messages)

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingRequest):
    prompt: (
        Annotated[str, Field(max_length=4_000_000)]
        | Annotated[list[str], Field(min_length=1, max_length=1)]
        | Annotated[list[Annotated[int, Field(ge=0, le=2**31 - 1)]], Field(min_length=1, max_length=1_000_000)]
    )
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = Field(default=False, description="Only false is supported.")
    suffix: None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo=true is not supported")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def prompt_chars(self) -> int:
        """Characters of a text prompt; 0 for token ids (their count is checked against the context)."""
        if isinstance(self.prompt, str):
            return len(self.prompt)
        return len(self.prompt[0]) if isinstance(self.prompt[0], str) else 0

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class SheddingRequest(BaseModel):
    """Admin: shed exactly `classes` (the operator's choice; [] turns shedding off), or, without
    `classes`, turn shedding on for the `levels` least important classes (`enabled`) or off."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    levels: int = Field(default=1, ge=1, le=16, description="How many of the least important classes to shed.")
    classes: list[str] | None = Field(default=None, max_length=16)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def internal_error_message(request_id: str) -> str:
    """The message of an error whose cause is the server's own: the cause (exception text, paths,
    device errors) goes to the server log under `request_id`, never to the client."""
    return f"internal error while processing the request; the server log has the cause under request id {request_id}"
