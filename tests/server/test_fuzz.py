"""Fuzz the HTTP API from its own OpenAPI schema with hypothesis: never a 5xx, never a hang.

Bodies are drawn from each POST route's request schema (mostly schema-valid, so they reach the
engine) and from arbitrary JSON and bytes (so they exercise validation), sent to a real server on
the simulated runner with a small context so that valid requests stay fast. `schema_strategy`
covers the JSON-schema subset pydantic emits for our models (hypothesis-jsonschema does not work
with this hypothesis version).
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import RunningServer, serve, sim_config, simulated

ROUTES = ["/v1/chat/completions", "/v1/completions"]


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[RunningServer]:
    config = sim_config(admission__max_model_len=96)
    with serve(simulated(config), config) as s:
        yield s


def inline_refs(node: Any, components: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        if "$ref" in node:
            return inline_refs(components[node["$ref"].rsplit("/", 1)[-1]], components)
        return {k: inline_refs(v, components) for k, v in node.items() if k not in ("title", "description", "examples")}
    if isinstance(node, list):
        return [inline_refs(v, components) for v in node]
    return node


def body_schemas(url: str) -> dict[str, dict[str, Any]]:
    spec = httpx.get(url + "/openapi.json").json()
    components = spec["components"]["schemas"]
    out = {}
    for path in ROUTES:
        ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        out[path] = inline_refs(ref, components)
    return out


def schema_strategy(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    if "anyOf" in schema or "oneOf" in schema:
        return st.one_of([schema_strategy(s) for s in schema.get("anyOf", schema.get("oneOf"))])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        lo = schema.get("minimum", schema.get("exclusiveMinimum"))
        hi = schema.get("maximum", schema.get("exclusiveMaximum"))
        return st.floats(lo, hi, allow_nan=False, allow_infinity=False,
                         exclude_min="exclusiveMinimum" in schema, exclude_max="exclusiveMaximum" in schema)
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 40), 40))
    if kind == "array":
        return st.lists(schema_strategy(schema.get("items", {})), min_size=schema.get("minItems", 0),
                        max_size=min(schema.get("maxItems", 4), 4))
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        return st.fixed_dictionaries(
            {k: schema_strategy(v) for k, v in props.items() if k in required},
            optional={k: schema_strategy(v) for k, v in props.items() if k not in required},
        )
    return json_values


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)


def send(s: RunningServer, path: str, body: Any) -> httpx.Response:
    data = json.dumps(body) if not isinstance(body, bytes) else body
    with httpx.Client(timeout=30) as c:
        r = c.post(s.url + path, content=data, headers={"content-type": "application/json"})
        r.read()
        return r


def check(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and err["type"]


def test_schema_valid_bodies_never_5xx(fuzz_server: RunningServer) -> None:
    schemas = body_schemas(fuzz_server.url)
    strategy = st.sampled_from(ROUTES).flatmap(
        lambda p: st.tuples(st.just(p), schema_strategy(schemas[p]))
    )

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(case: tuple[str, dict[str, Any]]) -> None:
        path, body = case
        if isinstance(body, dict):
            body["model"] = "simulated"  # unknown models are tested elsewhere; reach the engine here
            if isinstance(body.get("max_tokens"), int):
                body["max_tokens"] = min(body["max_tokens"], 8)  # keep runs short; range checks are tested elsewhere
        r = send(fuzz_server, path, body)
        check(r)
        statuses.append(r.status_code)

    statuses: list[int] = []
    run()
    assert 200 in statuses, statuses  # the schema-driven cases do reach the engine


def test_arbitrary_json_and_bytes_never_5xx(fuzz_server: RunningServer) -> None:
    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(ROUTES), st.one_of(json_values, st.dictionaries(st.sampled_from(
        ["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "stop", "stream", "n", "logprobs",
         "stream_options", "priority_class", "deadline_ms", "user", "seed", "top_k"]), json_values, max_size=8),
        st.binary(max_size=40)))
    def run(path: str, body: Any) -> None:
        check(send(fuzz_server, path, body))

    run()
    assert httpx.get(fuzz_server.url + "/readyz").status_code == 200
