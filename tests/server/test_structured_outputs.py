"""Structured outputs and tool calls on the real model, through real HTTP and the real `openai` client.

Every answer that carried a contract and ended by itself parses and validates against its schema
(checked here with `jsonschema`, independently of the server's own check); one cut by `length`
says `unverified`. Forced tool calls (`required`, a named function) are constrained by the
grammar, so the round trip call -> tool result -> final answer works even with a 135M model.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from .conftest import RunningServer

pytestmark = pytest.mark.model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"],
                   "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"],
                   "additionalProperties": False}}}


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)


def post(server: RunningServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.v1 + "/chat/completions", json=body, timeout=120)


class City(BaseModel):
    name: str
    country: str


def test_parse_with_a_pydantic_model(model_server: RunningServer) -> None:
    before = model_server.metric("magnitude_output_contract_total", result="valid")
    completion = client(model_server).beta.chat.completions.parse(
        model=model_server.engine.model_name, messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City, max_tokens=60, temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    assert choice.message.parsed.name
    assert (completion.model_extra or {})["timing"]["output_contract"] == "valid"
    assert model_server.metric("magnitude_output_contract_total", result="valid") == before + 1


def test_json_object_streams_and_its_masked_logprobs_name_only_allowed_tokens(model_server: RunningServer) -> None:
    stream = client(model_server).chat.completions.create(
        model=model_server.engine.model_name, messages=[{"role": "user", "content": "Give me a JSON object about a cat."}],
        response_format={"type": "json_object"}, max_tokens=60, temperature=0, stream=True, logprobs=True, top_logprobs=5)
    text, first_top, finish, timing = "", None, None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            if first_top is None and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
                first_top = chunk.choices[0].logprobs.content[0].top_logprobs
            finish = chunk.choices[0].finish_reason or finish
        timing = (chunk.model_extra or {}).get("timing") or timing
    # The grammar's mask comes first: every alternative at the first position opens an object
    # (unmasked, the model's favourites there are words). Logprobs report the masked distribution.
    assert first_top and all(t.token.startswith("{") for t in first_top), first_top
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
        assert timing["output_contract"] == "valid"
    else:
        assert finish == "length" and timing["output_contract"] == "unverified"


def schemas() -> st.SearchStrategy[dict[str, Any]]:
    """Small object schemas of the kinds clients send, bounded so answers stay short."""
    leaf = st.one_of(
        st.just({"type": "boolean"}),
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-50, 50), st.integers(0, 100)),
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 12)),
        st.builds(lambda vals: {"type": "string", "enum": vals},
                  st.lists(st.sampled_from(["red", "green", "blue", "cat", "dog"]), min_size=1, max_size=3, unique=True)),
        st.builds(lambda n: {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": n},
                  st.integers(1, 3)),
    )
    names = st.sampled_from(["name", "age", "color", "ok", "count", "tags", "city"])
    return st.dictionaries(names, leaf, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False})


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas())
def test_every_finished_answer_validates_against_its_generated_schema(model_server: RunningServer, schema: dict[str, Any]) -> None:
    r = post(model_server, {"messages": [{"role": "user", "content": "Fill in this JSON object."}],
                            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}},
                            "max_tokens": 48, "temperature": 0.7, "seed": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    if choice["finish_reason"] == "stop":
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
        assert body["timing"]["output_contract"] == "valid"
    else:
        assert body["timing"]["output_contract"] == "unverified"


def test_tool_round_trip_with_a_named_call(model_server: RunningServer) -> None:
    c = client(model_server)
    name = model_server.engine.model_name
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = c.chat.completions.create(model=name, messages=messages, tools=[WEATHER, TIME], max_tokens=40, temperature=0,
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments)["city"]
    assert (first.model_extra or {})["timing"]["output_contract"] == "valid"
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    final = c.chat.completions.create(model=name, messages=messages, tools=[WEATHER, TIME], max_tokens=40, temperature=0)
    answer = final.choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert "21" in (answer.message.content or ""), answer.message.content  # the answer uses the tool's result


def test_required_tool_calls_stream_as_tool_call_deltas(model_server: RunningServer) -> None:
    stream = client(model_server).chat.completions.create(
        model=model_server.engine.model_name, messages=[{"role": "user", "content": "Weather and time in Rome?"}],
        tools=[WEATHER, TIME], tool_choice="required", max_tokens=80, temperature=0, stream=True)
    calls, finish, content = [], None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert content == ""  # forced calls never leak as text
    assert calls and [c.index for c in calls] == list(range(len(calls)))
    for c in calls:
        assert c.function.name in ("get_weather", "get_time")
        jsonschema.validate(json.loads(c.function.arguments), WEATHER["function"]["parameters"])


def test_parallel_tool_calls_false_allows_one_call(model_server: RunningServer) -> None:
    r = post(model_server, {"messages": [{"role": "user", "content": "Weather in Rome, Oslo and Lima?"}],
                            "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False,
                            "max_tokens": 60, "temperature": 0})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["message"]["tool_calls"]) == 1


@pytest.mark.parametrize("patch,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema"),
    # Valid JSON Schema that xgrammar cannot compile (a look-behind): named, before anything is queued.
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "absent"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}], "tool_choice": "required"},
     "tools.0.function.parameters"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
])
def test_bad_contracts_are_refused_by_name(model_server: RunningServer, patch: dict[str, Any], param: str) -> None:
    r = post(model_server, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **patch})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
