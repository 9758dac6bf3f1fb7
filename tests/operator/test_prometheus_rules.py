"""The chart's PrometheusRule evaluated by Prometheus' own rule engine (`promtool test rules`).

The rules are rendered with `helm template` exactly as a user installs them, for a whole-number
and a fractional TTFT SLO. The input series carry the `le` labels the engine's real metrics
adapter writes (prometheus_client's exposition, read back here), so a rule that spells a bound
differently (`le="5"` against the engine's `le="5.0"`) matches no series and the test fails: one
service meets its SLO and must not alert, the other misses it for 9 requests in 10 and must.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from magnitude.server.metrics import EngineMetrics
from opkit import ROOT, e2e_module

CHART = ROOT / "charts" / "magnitude"
TTFT = "magnitude_time_to_first_token_seconds"
MINUTES = 90  # long enough for the 1h window to fill
# Requests per minute and their TTFTs: every one fast, or 9 in 10 far above any SLO tested (a burn
# rate of 18 against the default 95% target, over the alert's 14.4).
TRAFFIC = {"healthy": [0.1] * 10, "burning": [0.1] + [60.0] * 9}


def engine_le_labels() -> list[str]:
    """The `le` values of the TTFT histogram as the engine's /metrics writes them."""
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry=registry)
    metrics.ttft.labels("interactive", "t").observe(0.1)
    text = generate_latest(registry).decode()
    return [s.labels["le"] for f in text_string_to_metric_families(text) if f.name == TTFT
            for s in f.samples if s.name == f"{TTFT}_bucket"]


def input_series(les: list[str]) -> list[dict[str, str]]:
    series = []
    for service, ttfts in TRAFFIC.items():
        labels = f'namespace="ns", service="{service}", priority_class="interactive", tenant="t"'
        for le in les:
            per_minute = sum(1 for t in ttfts if t <= float(le))
            series.append({"series": f'{TTFT}_bucket{{{labels}, le="{le}"}}', "values": f"0+{per_minute}x{MINUTES}"})
        series.append({"series": f"{TTFT}_count{{{labels}}}", "values": f"0+{len(ttfts)}x{MINUTES}"})
    return series


def rendered_groups(*helm_args: str) -> list[dict[str, Any]]:
    helm = e2e_module("cluster").require_tool("helm")
    out = subprocess.run([helm, "template", "rel", str(CHART), "--namespace", "magnitude-system",
                          "--api-versions", "monitoring.coreos.com/v1/PrometheusRule", *helm_args],
                         check=True, capture_output=True, text=True).stdout
    rule = next(d for d in yaml.safe_load_all(out) if d and d["kind"] == "PrometheusRule")
    return rule["spec"]["groups"]


@pytest.mark.parametrize("slo_args", [
    pytest.param(("--set", "prometheusRule.ttftSloSeconds=5"), id="whole-number-set"),
    pytest.param(("--set-json", "prometheusRule.ttftSloSeconds=10.0"), id="whole-number-float"),
    pytest.param(("--set", "prometheusRule.ttftSloSeconds=2.5"), id="fractional"),
    pytest.param((), id="chart-default"),
])
def test_ttft_burn_alert_fires_only_for_the_service_missing_its_slo(slo_args: tuple[str, ...],
                                                                    tmp_path: Path) -> None:
    promtool = e2e_module("cluster").require_tool("promtool")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rendered_groups(*slo_args)}))
    burning = {"severity": "critical", "namespace": "ns", "service": "burning"}
    tests = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": input_series(engine_le_labels()),
            "alert_rule_test": [{
                "eval_time": f"{MINUTES - 5}m",
                "alertname": "MagnitudeTTFTSLOBurn",
                "exp_alerts": [{
                    "exp_labels": burning,
                    "exp_annotations": {
                        "summary": "TTFT SLO burning 14x on ns/burning",
                        "description": "More than 90% of requests exceed the TTFT bound.",
                    },
                }],
            }],
        }],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(tests))
    proc = subprocess.run([promtool, "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_engine_writes_whole_bounds_with_a_decimal_point() -> None:
    """The premise of the chart's `magnitude.promLe`: the engine writes `5.0`, never `5`."""
    les = engine_le_labels()
    assert "5.0" in les and "2.5" in les and "5" not in les, les
