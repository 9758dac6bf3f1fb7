"""What a chat answer must be, and what it turned out to be.

`plan_answer` reads a request's `response_format`, `tools`, `tool_choice` and
`parallel_tool_calls` into an `AnswerPlan`: the tools to offer, the output contract decoding is
constrained to (if any), and how the finished text becomes OpenAI's message. `AnswerPlan.finish`
does that at the end of generation: `content` and/or `tool_calls`, the `finish_reason`
(`tool_calls` when the answer holds calls and ended by itself), and the contract's verdict
(`valid` / `invalid` / `unverified`, None when the answer carried no contract), which the server
reports in `timing.output_contract` and counts in `magnitude_output_contract_total{result}`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from magnitude.server.protocol import ChatCompletionRequest, NamedToolChoice
from magnitude.server.structured import ContractResult, OutputContract, SchemaError, check_output, check_schema
from magnitude.server.tools import ANY_OBJECT, CALL_OPEN, Function, ToolPlan, call_arguments_contracts, parse_answer


class PlanError(ValueError):
    """A request whose contract cannot be built: `param` names the offending field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class Answer:
    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str = "stop"
    contract: ContractResult | None = None


@dataclass(frozen=True)
class AnswerPlan:
    tools: ToolPlan | None = None
    contract: OutputContract | None = None
    contract_param: str | None = None  # the request field the contract comes from (for errors)

    @property
    def parses_calls(self) -> bool:
        return self.tools is not None and self.tools.mode != "none"

    def finish(self, text: str, finish_reason: str) -> Answer:
        if not self.parses_calls:
            verdict = check_output(self.contract, text, finish_reason) if self.contract is not None else None
            return Answer(text, [], finish_reason, verdict)
        assert self.tools is not None
        parsed = parse_answer(self.tools, text)
        ended = finish_reason == "stop"
        reason = "tool_calls" if parsed.calls and ended else finish_reason
        if self.contract is not None:  # forced calls: the grammar's own contract
            verdict: ContractResult | None = check_output(self.contract, text, finish_reason)
        elif parsed.calls or CALL_OPEN in text:  # auto: each call's arguments against its function
            verdict = _auto_verdict(self.tools, parsed, finish_reason)
        else:
            verdict = None
        if not parsed.calls:
            return Answer(parsed.content if parsed.content is not None else text, [], finish_reason, verdict)
        return Answer(parsed.content, parsed.calls, reason, verdict)


def _auto_verdict(plan: ToolPlan, parsed: Any, finish_reason: str) -> ContractResult:
    if finish_reason != "stop":
        return "unverified"
    if not parsed.valid or not parsed.calls:
        return "invalid"
    for call, contract in zip(parsed.calls, call_arguments_contracts(plan, parsed.calls)):
        if check_output(contract, call["function"]["arguments"], "stop") != "valid":
            return "invalid"
    return "valid"


def plan_answer(body: ChatCompletionRequest) -> AnswerPlan:
    """The request's AnswerPlan; PlanError naming the field when a schema is not valid."""
    contract: OutputContract | None = None
    param: str | None = None
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        contract, param = OutputContract("json_object", dict(ANY_OBJECT)), "response_format"
    elif fmt is not None and fmt.type == "json_schema":
        assert fmt.json_schema is not None
        schema = fmt.json_schema.schema_
        _check(schema, "response_format.json_schema.schema")
        contract, param = OutputContract("json_schema", schema), "response_format.json_schema.schema"
    tools: ToolPlan | None = None
    if body.tools:
        functions = []
        for i, t in enumerate(body.tools):
            params = t.function.parameters if t.function.parameters is not None else dict(ANY_OBJECT)
            _check(params, f"tools.{i}.function.parameters")
            functions.append(Function(t.function.name, t.function.description, params))
        named = body.tool_choice.function.name if isinstance(body.tool_choice, NamedToolChoice) else None
        parallel = body.parallel_tool_calls if body.parallel_tool_calls is not None else True
        tools = ToolPlan(tuple(functions), body.tool_mode, named, parallel)  # type: ignore[arg-type]
        forced = tools.contract()
        if forced is not None:
            contract, param = forced, "tool_choice"
    return AnswerPlan(tools, contract, param)


def _check(schema: Any, param: str) -> None:
    try:
        check_schema(schema)
    except SchemaError as exc:
        raise PlanError(f"{param}: {exc}", param) from exc
