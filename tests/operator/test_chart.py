"""The Helm chart: least-privilege RBAC equal to what the operator uses, a lint-clean render (when a
`helm` binary is available), and observability that only queries metrics the engine exports."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from magnitude.operator.apply import KOPF_PERMISSIONS, PERMISSIONS
from magnitude.server.metrics import EngineMetrics
from opkit import ROOT, e2e_module

CHART = ROOT / "charts" / "magnitude"
KUBE_VERSION = "1.31.0"


def helm_binary() -> str | None:
    """helm as `make e2e-build` builds it (e2e/.bin/helm), else the one on PATH."""
    return e2e_module("cluster").tool_binary("helm")


def require_helm() -> str:
    """The helm binary; skip without one, or fail under CI=true (the control-plane suites' rule)."""
    return e2e_module("cluster").require_tool("helm", "The rules-file checks still ran")


def triples(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def declared() -> set[tuple[str, str, str]]:
    merged: dict[tuple[str, str], set[str]] = {}
    for table in (PERMISSIONS, KOPF_PERMISSIONS):
        for key, verbs in table.items():
            merged.setdefault(key, set()).update(verbs)
    return {(g, r, v) for (g, r), verbs in merged.items() for v in verbs}


def test_rbac_rules_grant_exactly_what_the_operator_uses() -> None:
    rules = yaml.safe_load((CHART / "files" / "operator-rules.yaml").read_text())
    granted = triples(rules)
    assert granted == declared(), f"missing: {declared() - granted}, extra: {granted - declared()}"
    assert not any("*" in x for t in granted for x in t)


def test_rbac_template_grants_only_the_rules_file() -> None:
    text = (CHART / "templates" / "rbac.yaml").read_text()
    assert text.count("rules:") == 1 and '.Files.Get "files/operator-rules.yaml"' in text


def render(*args: str) -> list[dict[str, Any]]:
    helm = require_helm()
    out = subprocess.run([helm, "template", "rel", str(CHART), "--namespace", "magnitude-system",
                          "--kube-version", KUBE_VERSION, *args], check=True, capture_output=True, text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_helm_lint_is_clean() -> None:
    helm = require_helm()
    proc = subprocess.run([helm, "lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_rendered_chart_all_namespaces() -> None:
    docs = render("--api-versions", "monitoring.coreos.com/v1/PrometheusRule")
    by_kind = {d["kind"]: d for d in docs}
    assert triples(by_kind["ClusterRole"]["rules"]) == declared()
    binding = by_kind["ClusterRoleBinding"]
    sa = by_kind["ServiceAccount"]["metadata"]["name"]
    assert binding["subjects"][0]["name"] == sa and binding["roleRef"]["name"] == by_kind["ClusterRole"]["metadata"]["name"]
    pod = by_kind["Deployment"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa and by_kind["Deployment"]["spec"]["replicas"] == 1
    assert pod["containers"][0]["command"][:2] == ["magnitude", "operator"]
    assert "PrometheusRule" in by_kind and "ConfigMap" in by_kind  # alerts and dashboard ship with it
    # Pod patches narrowed to the deletion-cost annotation of the operator's own pods, for its account only.
    policy = by_kind["ValidatingAdmissionPolicy"]
    user = f"system:serviceaccount:magnitude-system:{sa}"
    assert [c["expression"] for c in policy["spec"]["matchConditions"]] == [f"request.userInfo.username == '{user}'"]
    assert by_kind["ValidatingAdmissionPolicyBinding"]["spec"]["policyName"] == policy["metadata"]["name"]
    # The token key: the kubelet hands it to the operator; the operator has no right to read Secrets.
    key = by_kind["Secret"]
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["MAGNITUDE_OPERATOR_TOKEN_KEY"]["valueFrom"]["secretKeyRef"]["name"] == key["metadata"]["name"]
    assert {r["verbs"][0] for r in by_kind["ClusterRole"]["rules"] if "secrets" in r["resources"]} == {"create"}


def test_rendered_chart_watched_namespaces_binds_per_namespace() -> None:
    docs = render("--set", "watchNamespaces={team-a,team-b}")
    kinds = [d["kind"] for d in docs]
    assert "ClusterRoleBinding" not in kinds and "PrometheusRule" not in kinds  # no CRD advertised: no rule
    assert sorted(d["metadata"]["namespace"] for d in docs if d["kind"] == "RoleBinding") == ["team-a", "team-b"]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["MAGNITUDE_WATCH_NAMESPACES"] == "team-a,team-b"


# ---- observability --------------------------------------------------------------------------------


def engine_series() -> set[str]:
    """Every series name the engine's /metrics can carry (from its own adapter, fresh registry)."""
    registry = CollectorRegistry()
    EngineMetrics(registry=registry).register_decisions(dict)  # the engine registers its decision log's counts
    names: set[str] = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    for family in registry.collect():
        for suffix in suffixes.get(family.type, ("",)):
            names.add(family.name + suffix)
    return names


def queried(text: str) -> set[str]:
    return set(re.findall(r"\bmagnitude_[a-z_]+\b", text))


def dashboard() -> dict[str, Any]:
    return json.loads((CHART / "dashboards" / "magnitude.json").read_text())


def test_dashboard_and_alerts_query_only_engine_metrics() -> None:
    exprs = " ".join(t["expr"] for p in dashboard()["panels"] for t in p["targets"])
    exprs += " ".join(v.get("query", "") for v in dashboard()["templating"]["list"])
    rules = (CHART / "files" / "prometheus-rules.yaml").read_text()
    used = queried(exprs) | queried(rules)
    assert used, "nothing queried?"
    assert used <= engine_series(), f"not exported by the engine: {sorted(used - engine_series())}"


def test_ttft_slo_bound_is_a_histogram_bucket() -> None:
    from magnitude.server.metrics import LATENCY_BUCKETS

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert float(values["prometheusRule"]["ttftSloSeconds"]) in LATENCY_BUCKETS


def test_dashboard_covers_the_promised_panels() -> None:
    exprs = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in dashboard()["panels"]}
    def has(metric: str, by: str) -> bool:
        return any(metric in e and by in e for e in exprs.values())
    assert has("time_to_first_token", "priority_class") and has("inter_token_latency", "priority_class")
    assert has("queue_time", "priority_class") and has("kv_cache_usage_ratio", "service")
    assert has("preemptions_total", "reason") and has("rejections_total", "reason")
    assert has("engine_ready", "service") and has("admission_shedding", "service")
    # issue 16: request rate, error rate by reason, E2E, prefix hit rate, batch occupancy, decisions by reason
    assert has("requests_finished_total", "status") and has("rejections_total", "by (reason)")
    assert has("e2e_request_latency", "priority_class") and has("prefix_cache_hits_total", "prefix_cache_queries_total")
    assert has("batch_token_occupancy", "batch_sequence_occupancy") and has("decisions_total", "kind, reason")
    every = " ".join(exprs.values())
    # Grafana's window, not a fixed one; and no label only one way of scraping has (job, service)
    assert "$__rate_interval" in every and not re.search(r"\[\d+[smh]\]", every)
    assert not re.search(r"\b(job|service)\s*[=!]~?", every) and "by (service" not in every


def test_alerts_cover_kv_full_shedding_and_ttft_burn() -> None:
    groups = yaml.safe_load((CHART / "files" / "prometheus-rules.yaml").read_text().replace('{{ "{{" }}', "{{")
                            .replace('{{ "}}" }}', "}}"))
    alerts = {r["alert"]: r["expr"] for g in groups for r in g["rules"]}
    assert set(alerts) == {"MagnitudeKVCacheNearFullAtMaxReplicas", "MagnitudeSheddingProlonged",
                           "MagnitudeTTFTSLOBurn"}
