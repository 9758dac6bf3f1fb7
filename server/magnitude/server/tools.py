"""Tool calls: offering tools to the model, constraining forced calls, and reading calls back.

How tools reach the model: through the chat template's own tools block
(`apply_chat_template(tools=...)`) when it has one; otherwise (SmolLM2's template has none) in
Magnitude's default format, a system message listing each tool's JSON schema and asking for
calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the Hermes / Qwen
convention). Earlier calls and their results are rendered back as plain lines: an assistant
turn's `tool_calls` as `Calling NAME(ARGUMENTS) [ID]`, a `tool` message as a user turn
`NAME [ID] returned: CONTENT` (NAME from the message's `name` or from the call it answers).
Plain lines, not the call blocks: with SmolLM2-135M, call blocks in the history made the model
repeat the call instead of answering from its result (measured with the real model; the round
trip in tests/server/test_structured_outputs.py holds the format to that).

`tool_choice`:
- `none`: the tools are not offered and nothing is parsed;
- `auto`: the tools are offered; `<tool_call>` blocks in the answer become `tool_calls`, the text
  before the first one the message's `content`;
- `required`: decoding is constrained to a JSON array of `{"name", "arguments"}` calls (one at
  most when `parallel_tool_calls` is false), each an instance of its function's schema;
- a named function: decoding is constrained to that function's `parameters` schema, and the
  answer is its `arguments`.
`finish_reason` is `tool_calls` whenever the answer holds calls and ended by itself.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from magnitude.server.structured import OutputContract

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_BLOCK = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.DOTALL)
ANY_OBJECT: dict[str, Any] = {"type": "object"}

ToolMode = Literal["none", "auto", "required", "named"]


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools and what `tool_choice` makes of them."""

    functions: tuple[Function, ...]
    mode: ToolMode
    named: str | None = None
    parallel: bool = True

    @property
    def offered(self) -> bool:
        return self.mode != "none" and bool(self.functions)

    def function(self, name: str) -> Function | None:
        return next((f for f in self.functions if f.name == name), None)

    def contract(self) -> OutputContract | None:
        """The grammar forced calls are decoded under (None for `auto` and `none`)."""
        if self.mode == "named":
            fn = self.function(self.named or "")
            assert fn is not None
            return OutputContract("json_schema", fn.parameters)
        if self.mode == "required":
            calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": [
                {"type": "object", "properties": {"name": {"const": f.name}, "arguments": f.parameters},
                 "required": ["name", "arguments"], "additionalProperties": False}
                for f in self.functions
            ]}}
            if not self.parallel:
                calls["maxItems"] = 1
            return OutputContract("tool_calls", calls)
        return None


@dataclass
class ParsedCalls:
    content: str | None
    calls: list[dict[str, Any]] = field(default_factory=list)
    valid: bool = True  # every call named an offered tool and had JSON arguments


def default_tools_prompt(functions: tuple[Function, ...]) -> str:
    listing = "\n".join(json.dumps(f.openai(), ensure_ascii=False) for f in functions)
    return (
        "You can call functions. The available functions, as JSON schemas:\n"
        f"{listing}\n"
        f"To call a function, answer with one {CALL_OPEN}{{\"name\": <function name>, \"arguments\": <arguments as a "
        f"JSON object>}}{CALL_CLOSE} block per call and nothing else."
    )


def _called(call: dict[str, Any]) -> str:
    arguments = call["function"]["arguments"]
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f"Calling {call['function']['name']}({text}) [{call['id']}]"


def render_default_format(messages: list[dict[str, Any]], plan: ToolPlan | None) -> list[dict[str, Any]]:
    """Messages for a template without a tools block: the tools as a system message (merged into
    the conversation's own first system message), calls and results as plain lines."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            names.update({c["id"]: c["function"]["name"] for c in m["tool_calls"]})
            lines = ([m["content"]] if m.get("content") else []) + [_called(c) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(lines)})
        elif m["role"] == "tool":
            call_id = m.get("tool_call_id")
            name = m.get("name") or names.get(call_id or "", "the tool")
            out.append({"role": "user", "content": f"{name} [{call_id}] returned: {m.get('content') or ''}"})
        else:
            out.append(dict(m))
    if plan is not None and plan.offered:
        prompt = default_tools_prompt(plan.functions)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def messages_for_template(renderer: Any, messages: list[dict[str, Any]], plan: ToolPlan | None
                          ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to give the chat template: as they are when it has a tools block,
    else in the default format (tools as a system message, calls and results as text)."""
    tools = [f.openai() for f in plan.functions] if plan is not None and plan.offered else None
    with_tool_fields = any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
    if (tools or with_tool_fields) and not renderer.renders_tools():
        return render_default_format(messages, plan), None
    return messages, tools


def parse_answer(plan: ToolPlan, text: str) -> ParsedCalls:
    """The answer as OpenAI's message: content and/or tool_calls, by the plan's mode."""
    if plan.mode == "named":
        return ParsedCalls(None, [_openai_call(plan.named or "", text)], valid=_is_json(text))
    if plan.mode == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return ParsedCalls(text, [], valid=False)
        if not isinstance(items, list):
            return ParsedCalls(text, [], valid=False)
        calls, ok = [], True
        for item in items:
            if isinstance(item, dict) and isinstance(item.get("name"), str) and plan.function(item["name"]):
                calls.append(_openai_call(item["name"], json.dumps(item.get("arguments", {}), ensure_ascii=False)))
            else:
                ok = False
        return ParsedCalls(None, calls, valid=ok and bool(calls))
    if plan.mode == "auto":
        start = text.find(CALL_OPEN)
        if start < 0:
            return ParsedCalls(text)
        calls, ok = [], True
        for block in _CALL_BLOCK.findall(text[start:]):
            try:
                item = json.loads(block)
            except ValueError:
                ok = False
                continue
            if isinstance(item, dict) and isinstance(item.get("name"), str) and plan.function(item["name"]):
                calls.append(_openai_call(item["name"], json.dumps(item.get("arguments", {}), ensure_ascii=False)))
            else:
                ok = False
        if not calls:
            return ParsedCalls(text, [], valid=False)
        content = text[:start].strip() or None
        return ParsedCalls(content, calls, valid=ok)
    return ParsedCalls(text)


def call_arguments_contracts(plan: ToolPlan, calls: list[dict[str, Any]]) -> list[OutputContract]:
    """Per parsed call, the contract its arguments must meet (its function's parameters)."""
    out = []
    for c in calls:
        fn = plan.function(c["function"]["name"])
        out.append(OutputContract("json_schema", fn.parameters if fn else ANY_OBJECT))
    return out


def _openai_call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class AutoCallFilter:
    """Streaming in `auto` mode: passes content through until a `<tool_call>` may be starting,
    then holds the rest back for `parse_answer` at the end (so no call text leaks as content)."""

    def __init__(self) -> None:
        self.text = ""
        self._emitted = 0
        self._holding = False

    def feed(self, delta: str) -> str:
        """Content that can be sent now."""
        self.text += delta
        if self._holding:
            return ""
        start = self.text.find(CALL_OPEN, self._emitted)
        if start >= 0:
            self._holding = True
            return self._emit(start)
        # Keep back a tail that could be the beginning of CALL_OPEN.
        keep = next((k for k in range(min(len(CALL_OPEN) - 1, len(self.text) - self._emitted), 0, -1)
                     if self.text.endswith(CALL_OPEN[:k])), 0)
        return self._emit(len(self.text) - keep)

    def _emit(self, end: int) -> str:
        out, self._emitted = self.text[self._emitted:end], max(self._emitted, end)
        return out

    def rest(self) -> str:
        """What was held back, once the answer is complete."""
        return self.text[self._emitted:]
