"""Tool-call parsing and the streaming hold-back of `auto` mode (pure functions, no server)."""

from __future__ import annotations

import json

from magnitude.server.answer import AnswerPlan
from magnitude.server.tools import AutoCallFilter, Function, ToolPlan, parse_answer, render_default_format

WEATHER = Function("get_weather", "weather", {"type": "object", "properties": {"city": {"type": "string"}},
                                              "required": ["city"]})
AUTO = ToolPlan((WEATHER,), "auto")


def test_auto_mode_reads_calls_after_content() -> None:
    text = 'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n' \
           '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    parsed = parse_answer(AUTO, text)
    assert parsed.content == "Let me check." and parsed.valid
    assert [json.loads(c["function"]["arguments"])["city"] for c in parsed.calls] == ["Oslo", "Rome"]
    answer = AnswerPlan(AUTO).finish(text, "stop")
    assert answer.finish_reason == "tool_calls" and answer.contract == "valid"


def test_auto_mode_without_calls_is_plain_content_and_carries_no_contract() -> None:
    answer = AnswerPlan(AUTO).finish("It is sunny.", "stop")
    assert (answer.content, answer.tool_calls, answer.finish_reason, answer.contract) == ("It is sunny.", [], "stop", None)


def test_a_call_to_an_unknown_tool_or_bad_arguments_is_invalid() -> None:
    bad_name = AnswerPlan(AUTO).finish('<tool_call>{"name": "launch", "arguments": {}}</tool_call>', "stop")
    assert bad_name.tool_calls == [] and bad_name.contract == "invalid"
    bad_args = AnswerPlan(AUTO).finish('<tool_call>{"name": "get_weather", "arguments": {"town": 1}}</tool_call>', "stop")
    assert bad_args.tool_calls and bad_args.contract == "invalid"  # city is required
    cut = AnswerPlan(AUTO).finish('<tool_call>{"name": "get_weather", "argu', "length")
    assert cut.contract == "unverified" and cut.finish_reason == "length"


def test_streaming_holds_back_what_may_be_a_call() -> None:
    f = AutoCallFilter()
    sent = [f.feed(piece) for piece in ["Sure", ", checking <tool", "_call>{\"name\": ", "\"get_weather\"}</tool_call>"]]
    assert "".join(sent) == "Sure, checking "  # the tag's beginning was held, then everything after it
    assert f.rest().startswith("<tool_call>")
    g = AutoCallFilter()
    assert g.feed("a <to") == "a " and g.feed("day") == "<today" and g.rest() == ""  # a false alarm is released


def test_default_format_merges_tools_into_the_system_message() -> None:
    out = render_default_format([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], AUTO)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\nYou can call functions.")
    assert '"name": "get_weather"' in out[0]["content"] and len(out) == 2
    none = ToolPlan((WEATHER,), "none")
    assert render_default_format([{"role": "user", "content": "hi"}], none) == [{"role": "user", "content": "hi"}]
