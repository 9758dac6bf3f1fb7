"""OpenAI wire models: what `/v1/completions` and `/v1/chat/completions` accept and return.

Requests are validated here (types, ranges, the Magnitude extensions `priority_class`,
`deadline_ms`, `ignore_eos`, `top_k`, `stream_options.include_progress`); checks that need the
engine (known model, known priority class, context length) live in `app.py`.

No silent drops: a field Magnitude does not implement is refused (400 naming it, code
`unsupported_parameter`), because a client that asked for JSON, a tool call or a logit bias and
got free text fails later and worse. Only IGNORED_FIELDS, which mean nothing to a self-hosted
engine, are accepted and dropped. Responses are built as plain dicts by `responses.py`; only
their stable shapes are described here.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from magnitude.engine.sampling import MAX_REPETITION_PENALTY

MAX_STOP_STRINGS = 8
MAX_STOP_LENGTH = 256
MAX_TOKENS_LIMIT = 1_000_000
MAX_LOGIT_BIAS = 1024  # entries (OpenAI allows 300)
MAX_STOP_TOKEN_IDS = 64


# Fields of OpenAI's request schemas that mean nothing to a self-hosted engine: accepted and
# dropped. `store`/`metadata`: OpenAI's stored completions; `service_tier`: OpenAI's capacity
# tiers; `safety_identifier`: OpenAI's abuse reporting (`user` is the tenant here, not ignored);
# `prompt_cache_key`: a routing hint for OpenAI's prompt cache (the prefix cache needs none).
IGNORED_FIELDS = frozenset({"store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key"})
# `stream_options.include_obfuscation`: OpenAI pads chunks against length side channels on its
# network; nothing to hide between a client and its own engine.
IGNORED_STREAM_OPTIONS = frozenset({"include_obfuscation"})


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class _Strict(BaseModel):
    """Undeclared fields are refused, never ignored (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")


def _drop(data: Any, names: frozenset[str]) -> Any:
    return {k: v for k, v in data.items() if k not in names} if isinstance(data, dict) else data


class StreamOptions(_Strict):
    @model_validator(mode="before")
    @classmethod
    def _drop_ignored(cls, data: Any) -> Any:
        return _drop(data, IGNORED_STREAM_OPTIONS)

    include_usage: bool = False
    include_progress: bool = Field(
        default=False, description="Magnitude extension: progress chunks (loading, queued, prefill, generating)."
    )


class _SamplingRequest(_Strict):
    """Fields shared by chat and text completions."""

    @model_validator(mode="before")
    @classmethod
    def _drop_ignored(cls, data: Any) -> Any:
        return _drop(data, IGNORED_FIELDS)

    model: str | None = Field(default=None, min_length=1, max_length=512,
                              description="May be omitted: the served model is used.")
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=1_000_000, description="Extension: 0 disables top-k.")
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=128, description="Choices; at most admission.maxChoices (default 8).")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=253)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    # vLLM's extensions, under vLLM's names (a stock client sends them through `extra_body`).
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=MAX_REPETITION_PENALTY)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    stop_token_ids: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
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

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
        return value

    @property
    def token_bias(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

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


class TextPart(_Strict):
    type: Literal["text"]
    text: str = Field(max_length=4_000_000)


class FunctionCall(_Strict):
    name: str = Field(min_length=1, max_length=256)
    arguments: str = Field(max_length=4_000_000, description="JSON text, as OpenAI sends it.")


class ToolCall(_Strict):
    """A call an earlier assistant turn made (conversation history sent back by the client)."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str, Field(max_length=4_000_000)] | list[TextPart] | None = None
    name: str | None = Field(default=None, max_length=256)
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=256)
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=128)

    @model_validator(mode="after")
    def _check_tool_fields(self) -> "ChatMessage":
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id: only allowed on role 'tool' messages")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: required on role 'tool' messages")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only allowed on role 'assistant' messages")
        return self

    def template_fields(self) -> dict[str, Any]:
        """The message as chat templates take it (Hugging Face's convention): optional fields only
        when set, and tool call arguments as an object when they are JSON (templates index them)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls is not None:
            out["tool_calls"] = [
                {"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                for c in self.tool_calls
            ]
        return out

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


class JSONSchemaFormat(_Strict):
    name: str = Field(default="response", pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = Field(default=None, max_length=100_000)
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = Field(default=None, description="Decoding is constrained whether or not strict is set.")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema_present(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema: required when type is 'json_schema'")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError("json_schema: only allowed when type is 'json_schema'")
        return self


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = Field(default=None, max_length=100_000)
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(default=None, description="Forced calls are constrained whether or not strict is set.")


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


MAX_TOOLS = 128


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        return self

    @model_validator(mode="after")
    def _check_tools(self) -> "ChatCompletionRequest":
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ValueError("tool_choice: requires tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice: names function '{self.tool_choice.function.name}', which is not in tools")
        if self.parallel_tool_calls is not None and not self.tools:
            raise ValueError("parallel_tool_calls: requires tools")
        if self.response_format is not None and self.response_format.type != "text" and self.tool_mode not in ("none",):
            raise ValueError("response_format: cannot be combined with tools unless tool_choice is 'none'")
        return self

    @property
    def tool_mode(self) -> str:
        """none | auto | required | named (OpenAI's default: auto when tools are given)."""
        if not self.tools:
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

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
    best_of: int | None = Field(default=None, ge=1, le=1, description="Only 1 (one candidate per choice).")
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


class TokenizeCompletionRequest(_Strict):
    """vLLM's `/tokenize` with a text prompt."""

    model: str | None = Field(default=None, min_length=1, max_length=512)
    prompt: str = Field(max_length=4_000_000)
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    """vLLM's `/tokenize` with chat messages (rendered by the chat template, as a chat request is)."""

    model: str | None = Field(default=None, min_length=1, max_length=512)
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = Field(default=None, min_length=1, max_length=512)
    tokens: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] = Field(max_length=1_000_000)


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
