"""Every example validates against the CRD (defaults, OpenAPI, CEL) and is servable as written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from magnitude.operator.spec import ModelServiceSpec
from magnitude.operator.validation import unsupported
from opkit import ROOT

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def test_the_promised_examples_exist() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"cpu-smollm2.yaml", "gpu.yaml", "priority-tenants.yaml", "autoscaling-shedding.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_is_valid_and_servable(path: Path, crd_validate: Any) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    services = [d for d in docs if d["kind"] == "ModelService"]
    assert services, f"{path.name} has no ModelService"
    for doc in services:
        defaulted, errors = crd_validate(doc)
        assert errors == [], errors
        spec = ModelServiceSpec.model_validate(defaulted["spec"])
        assert unsupported(spec) == []
    for doc in docs:
        ref = (doc.get("spec") or {}).get("scaleTargetRef")
        if ref:  # an HPA/KEDA target must be one of the ModelServices here
            assert ref["kind"] == "ModelService" and ref["name"] in {s["metadata"]["name"] for s in services}
