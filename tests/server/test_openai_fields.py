"""Every field of OpenAI's chat and completions request schemas is implemented, documented-ignored,
or refused with 400 naming it: never silently dropped.

The field lists come from the installed `openai` package's typed request params, so a field a
newer client adds fails `test_table_covers_every_openai_field` until it is classified here.
"""

from __future__ import annotations

import typing
from typing import Any

import httpx
import pytest
from openai.types import completion_create_params as text_params
from openai.types.chat import completion_create_params as chat_params

from magnitude.server.protocol import IGNORED_FIELDS
from magnitude.server.tokenization import PromptRenderer

from .conftest import RunningServer, serve, sim_config, simulated

IMPLEMENTED, IGNORED, REFUSED = "implemented", "ignored", "refused"

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}

# field -> (verdict, a value a client would send). Refused values are realistic requests, not junk:
# the refusal is about the feature, not the value.
CHAT_FIELDS: dict[str, tuple[str, Any]] = {
    "audio": (REFUSED, {"voice": "alloy", "format": "wav"}),
    "frequency_penalty": (IMPLEMENTED, 0.5),
    "function_call": (REFUSED, "auto"),
    "functions": (REFUSED, [TOOL["function"]]),
    "logit_bias": (IMPLEMENTED, {"50": 5}),
    "logprobs": (IMPLEMENTED, True),
    "max_completion_tokens": (IMPLEMENTED, 3),
    "max_tokens": (IMPLEMENTED, 3),
    "messages": (IMPLEMENTED, [{"role": "user", "content": "hi"}]),
    "metadata": (IGNORED, {"k": "v"}),
    "modalities": (REFUSED, ["text", "audio"]),
    "model": (IMPLEMENTED, "simulated"),
    "moderation": (REFUSED, {"model": "omni-moderation-latest"}),
    "n": (IMPLEMENTED, 1),
    "parallel_tool_calls": (IMPLEMENTED, False),
    "prediction": (REFUSED, {"type": "content", "content": "hello"}),
    "presence_penalty": (IMPLEMENTED, -0.5),
    "prompt_cache_key": (IGNORED, "conversation-1"),
    "prompt_cache_options": (REFUSED, {"mode": "explicit", "ttl": "30m"}),
    "prompt_cache_retention": (REFUSED, "24h"),
    "reasoning_effort": (REFUSED, "low"),
    "response_format": (IMPLEMENTED, {"type": "text"}),  # json_object / json_schema: test_structured_outputs.py
    "safety_identifier": (IGNORED, "hashed-user"),
    "seed": (IMPLEMENTED, 7),
    "service_tier": (IGNORED, "auto"),
    "stop": (IMPLEMENTED, ["\n\n"]),
    "store": (IGNORED, False),
    "stream": (IMPLEMENTED, False),
    "stream_options": (IMPLEMENTED, None),
    "temperature": (IMPLEMENTED, 0.0),
    "tool_choice": (IMPLEMENTED, "auto"),  # required / named: test_structured_outputs.py
    "tools": (IMPLEMENTED, [TOOL]),
    "top_logprobs": (IMPLEMENTED, 2),
    "top_p": (IMPLEMENTED, 0.9),
    "user": (IMPLEMENTED, "alice"),
    "verbosity": (REFUSED, "low"),
    "web_search_options": (REFUSED, {}),
}

TEXT_FIELDS: dict[str, tuple[str, Any]] = {
    "best_of": (IMPLEMENTED, 1),
    "echo": (IMPLEMENTED, False),
    "frequency_penalty": (IMPLEMENTED, 0.5),
    "logit_bias": (IMPLEMENTED, {"50": 5}),
    "logprobs": (IMPLEMENTED, 2),
    "max_tokens": (IMPLEMENTED, 3),
    "model": (IMPLEMENTED, "simulated"),
    "n": (IMPLEMENTED, 1),
    "presence_penalty": (IMPLEMENTED, -0.5),
    "prompt": (IMPLEMENTED, "hello"),
    "seed": (IMPLEMENTED, 7),
    "stop": (IMPLEMENTED, ["\n\n"]),
    "stream": (IMPLEMENTED, False),
    "stream_options": (IMPLEMENTED, None),
    "suffix": (IMPLEMENTED, None),
    "temperature": (IMPLEMENTED, 0.0),
    "top_p": (IMPLEMENTED, 0.9),
    "user": (IMPLEMENTED, "alice"),
}

# Accepted values that are not what the feature asks for: 400 naming the field, too.
UNSUPPORTED_VALUES: list[tuple[str, str, Any]] = [
    ("chat", "n", 9),  # above admission.maxChoices (8)
    ("text", "n", 9),
    ("text", "best_of", 2),
    ("text", "echo", True),
    ("text", "suffix", "after"),
    ("chat", "presence_penalty", 2.5),
    ("text", "frequency_penalty", -3),
    ("chat", "logit_bias", {"50": 101}),
    ("chat", "logit_bias", {"fifty": 1}),
    ("chat", "logit_bias", {"999999": 1}),  # outside the vocabulary
    ("text", "stop_token_ids", [999999]),
    ("chat", "repetition_penalty", 0),
    ("chat", "min_p", 1.5),
]


@pytest.mark.parametrize("field,value", [("repetition_penalty", 1.2), ("min_p", 0.1), ("stop_token_ids", [13])])
def test_vllm_sampling_extensions_are_accepted(sim_server: RunningServer, field: str, value: Any) -> None:
    for kind in ("chat", "text"):
        r = httpx.post(sim_server.v1 + route(kind), json=body_with(kind, field, value), timeout=30)
        assert r.status_code == 200, r.text


def schema_fields(typed: Any) -> set[str]:
    return set(typing.get_type_hints(typed))


def base_body(kind: str) -> dict[str, Any]:
    if kind == "chat":
        return {"model": "simulated", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    return {"model": "simulated", "prompt": "hello", "max_tokens": 3}


def route(kind: str) -> str:
    return "/chat/completions" if kind == "chat" else "/completions"


def body_with(kind: str, field: str, value: Any) -> dict[str, Any]:
    body = base_body(kind)
    body[field] = value
    if field == "top_logprobs":
        body["logprobs"] = True
    if field in ("tool_choice", "parallel_tool_calls"):
        body["tools"] = [TOOL]
    return body


def test_table_covers_every_openai_field() -> None:
    chat = schema_fields(chat_params.CompletionCreateParamsStreaming) | schema_fields(chat_params.CompletionCreateParamsNonStreaming)
    text = schema_fields(text_params.CompletionCreateParamsStreaming) | schema_fields(text_params.CompletionCreateParamsNonStreaming)
    assert set(CHAT_FIELDS) == chat
    assert set(TEXT_FIELDS) == text
    ignored = {f for table in (CHAT_FIELDS, TEXT_FIELDS) for f, (verdict, _) in table.items() if verdict == IGNORED}
    assert ignored == set(IGNORED_FIELDS)  # the documented list is exactly what the table ignores


CASES = [("chat", f, v, x) for f, (v, x) in CHAT_FIELDS.items()] + [("text", f, v, x) for f, (v, x) in TEXT_FIELDS.items()]


@pytest.mark.parametrize("kind,field,verdict,value", CASES, ids=[f"{k}-{f}" for k, f, _, _ in CASES])
def test_every_field_is_implemented_ignored_or_refused_by_name(sim_server: RunningServer, kind: str, field: str,
                                                              verdict: str, value: Any) -> None:
    r = httpx.post(sim_server.v1 + route(kind), json=body_with(kind, field, value), timeout=30)
    if verdict == REFUSED:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == field
        assert error["code"] == "unsupported_parameter"
        assert error["type"] == "invalid_request_error"
        assert field in error["message"]
    else:
        assert r.status_code == 200, r.text
        assert r.json()["choices"]


@pytest.mark.parametrize("kind,field,value", UNSUPPORTED_VALUES)
def test_unsupported_values_are_refused_by_name(sim_server: RunningServer, kind: str, field: str, value: Any) -> None:
    r = httpx.post(sim_server.v1 + route(kind), json=body_with(kind, field, value), timeout=30)
    assert r.status_code == 400, r.text
    param = r.json()["error"]["param"]
    assert param == field or param.startswith(field + "."), param  # `logit_bias.50` names the entry


@pytest.mark.parametrize(
    "body_patch,param",
    [
        ({"frobnicate": 1}, "frobnicate"),  # not OpenAI's either
        ({"stream": True, "stream_options": {"include_usage": True, "frobnicate": 1}}, "stream_options.frobnicate"),
        ({"messages": [{"role": "user", "content": "hi", "audio": {"id": "a"}}]}, "messages.0.audio"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages.0.content.0.image_url"),
    ],
)
def test_unknown_nested_fields_are_refused_by_name(sim_server: RunningServer, body_patch: dict[str, Any], param: str) -> None:
    body = {**base_body("chat"), **body_patch}
    r = httpx.post(sim_server.v1 + route("chat"), json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_ignored_stream_option_is_accepted(sim_server: RunningServer) -> None:
    body = {**base_body("chat"), "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}}
    r = httpx.post(sim_server.v1 + route("chat"), json=body, timeout=30)
    assert r.status_code == 200, r.text


def test_unsupported_field_is_named_before_other_errors(sim_server: RunningServer) -> None:
    body = {**base_body("chat"), "temperature": 9, "reasoning_effort": "low"}
    r = httpx.post(sim_server.v1 + route("chat"), json=body, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "reasoning_effort"


def test_constrained_decoding_is_refused_by_a_runner_that_cannot_do_it(sim_server: RunningServer) -> None:
    """The simulated runner has no sampler to mask: a contract it cannot honour is refused, not ignored."""
    for patch, param in (({"response_format": {"type": "json_object"}}, "response_format"),
                         ({"tools": [TOOL], "tool_choice": "required"}, "tool_choice")):
        r = httpx.post(sim_server.v1 + route("chat"), json={**base_body("chat"), **patch}, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
        assert "cannot constrain decoding" in r.json()["error"]["message"]


# -- message fields reach the chat template or are refused -------------------------------------------

TOOL_HISTORY = [
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


@pytest.mark.parametrize(
    "messages,param",
    [
        ([{"role": "user", "content": "hi", "name": "bob"}], "messages.0.name"),
    ],
)
def test_message_fields_the_template_drops_are_refused(sim_server: RunningServer, messages: list[dict[str, Any]],
                                                      param: str) -> None:
    # The simulated tokenizer's template renders role and content only, like SmolLM2's.
    r = httpx.post(sim_server.v1 + route("chat"), json={**base_body("chat"), "messages": messages}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert r.json()["error"]["code"] == "unsupported_parameter"


def test_tool_history_reaches_a_template_without_tools_in_the_default_format(sim_server: RunningServer) -> None:
    """The call and its result are rendered as text (tools.py's default format), ids and names kept."""
    r = httpx.post(sim_server.url + "/tokenize", json={"messages": TOOL_HISTORY, "return_token_strs": True}, timeout=30)
    assert r.status_code == 200, r.text
    text = httpx.post(sim_server.url + "/detokenize", json={"tokens": r.json()["tokens"]}, timeout=30).json()["prompt"]
    assert 'Calling get_weather({"city": "Oslo"}) [call_1]' in text
    assert "get_weather [call_1] returned: sunny" in text


@pytest.mark.parametrize(
    "message,needle",
    [
        ({"role": "tool", "content": "sunny"}, "tool_call_id"),  # a tool result must say which call it answers
        ({"role": "user", "content": "hi", "tool_call_id": "call_1"}, "tool_call_id"),
        ({"role": "user", "content": "hi", "tool_calls": []}, "tool_calls"),
    ],
)
def test_tool_fields_on_the_wrong_role_are_refused(sim_server: RunningServer, message: dict[str, Any], needle: str) -> None:
    r = httpx.post(sim_server.v1 + route("chat"), json={**base_body("chat"), "messages": [message]}, timeout=30)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


class ToolAwareTokenizer:
    """A template that renders name, tool_calls and tool_call_id (as Hugging Face tool templates do)."""

    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool = False, add_generation_prompt: bool = True) -> str:
        out = []
        for m in messages:
            extra = m.get("name", "")
            for call in m.get("tool_calls", []):
                extra += f" call {call['id']} {call['function']['name']}({call['function']['arguments']})"
            if "tool_call_id" in m:
                extra += f" answers {m['tool_call_id']}"
            out.append(f"[{m['role']}{extra}] {m['content']}")
        return "\n".join(out)


def test_message_fields_reach_a_template_that_renders_them() -> None:
    from magnitude.server.protocol import ChatCompletionRequest

    request = ChatCompletionRequest.model_validate({"model": "m", "messages": TOOL_HISTORY + [{"role": "user", "content": "ok", "name": "bob"}]})
    messages = [m.template_fields() for m in request.messages]
    renderer = PromptRenderer(ToolAwareTokenizer())
    assert renderer.unrendered_field(messages) is None
    text = ToolAwareTokenizer().apply_chat_template(messages)
    assert "answers call_1" in text and "bob" in text
    assert "get_weather({'city': 'Oslo'})" in text  # JSON arguments arrive as an object, as templates expect
    assert PromptRenderer(_ContentOnly()).unrendered_field(messages) == (1, "tool_calls")


class _ContentOnly:
    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool = False, add_generation_prompt: bool = True) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages)


# -- defaults as vLLM users expect ---------------------------------------------------------------------

def test_max_tokens_defaults_to_the_rest_of_the_context_and_model_may_be_omitted() -> None:
    # A context longer than the old fixed default (256) plus the prompt, so the two differ.
    config = sim_config(admission__max_model_len=400)
    with serve(simulated(config), config) as s:
        r = httpx.post(s.v1 + "/completions", json={"prompt": "hello there"}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        usage = body["usage"]
        assert body["model"] == "simulated"
        assert body["choices"][0]["finish_reason"] == "length"  # the simulated runner never samples EOS
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 400
        assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
