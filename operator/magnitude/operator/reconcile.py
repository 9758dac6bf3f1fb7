"""One reconcile of one ModelService: build -> observe -> plan -> execute -> status -> events.

Called by the Kopf change handlers (no autoscaler decision: the replica count comes from spec or
from status) and by the scale loop every tick (with a decision). Level-based and idempotent:
an unchanged spec plans no writes and an unchanged status is not written.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from pydantic import ValidationError

from magnitude.operator import autoscaler as a
from magnitude.operator import defaults as engine_defaults
from magnitude.operator import naming as n
from magnitude.operator import quantization as q
from magnitude.operator import status as st
from magnitude.operator.apply import ApiError, Kube
from magnitude.operator.desired import (DEFAULT_OPERATOR_NAMESPACE, Owner, absent_children, build_admin_secret,
                                        build_all, desired_replicas)
from magnitude.operator.plan import Apply, Plan, plan
from magnitude.operator.servicever import service_version
from magnitude.operator.spec import ModelServiceSpec, ModelServiceStatus
from magnitude.operator.validation import unsupported

log = logging.getLogger(__name__)
NORMAL, WARNING = "Normal", "Warning"
SHED_EVENTS = {a.SHED_STARTED: WARNING, a.SHED_ESCALATED: WARNING, a.SHED_REDUCED: NORMAL, a.SHED_STOPPED: NORMAL}
SCALING_EVENTS = {a.AT_MAX: WARNING, a.METRICS_UNAVAILABLE: WARNING, a.PODS_PENDING: NORMAL, a.PODS_STUCK: WARNING}
# QuantizationValidated changes worth an Event (reason "Quantization" + the condition's reason);
# Rejected is announced by Degraded's Warning (reason QuantizationRejected), not twice.
QUANTIZATION_EVENTS = {q.PASSED: NORMAL, q.FAILED_NOT_ENFORCED: WARNING}


OPERATOR_NAMESPACE_ENV = "MAGNITUDE_OPERATOR_NAMESPACE"  # the chart sets it from the downward API
SERVICE_ACCOUNT_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def operator_namespace() -> str:
    """Where this operator runs (a NetworkPolicy must admit its scrapes): the environment, else the
    in-cluster service account's namespace, else the chart's default."""
    found = os.environ.get(OPERATOR_NAMESPACE_ENV, "").strip()
    if not found and os.path.exists(SERVICE_ACCOUNT_NAMESPACE_FILE):
        with open(SERVICE_ACCOUNT_NAMESPACE_FILE) as f:
            found = f.read().strip()
    return found or DEFAULT_OPERATOR_NAMESPACE


TOKEN_KEY_ENV = "MAGNITUDE_OPERATOR_TOKEN_KEY"  # the chart passes its key Secret's value


@functools.cache
def installation_defaults() -> engine_defaults.EngineDefaults:
    """The chart's engine defaults, read once (a change rolls the operator's own pod)."""
    return engine_defaults.from_environment()


@functools.cache
def operator_key() -> bytes:
    """The key the engines' admin tokens are derived from (`desired.admin_token`). The chart keeps
    it in a Secret of its own namespace that the kubelet hands to the operator as an environment
    variable: the operator itself has no right to read any Secret. Without one (a development
    run), a key for this process only: engines then get new tokens, and roll, when it restarts."""
    key = os.environ.get(TOKEN_KEY_ENV, "")
    if key:
        return key.encode()
    log.warning("%s is not set: admin tokens are derived from a key of this process only; engine pods "
                "roll to new tokens when the operator restarts", TOKEN_KEY_ENV)
    return secrets.token_bytes(32)


class SpecInvalid(Exception):
    """The spec does not parse; retrying cannot help until someone edits it."""


@dataclass(frozen=True)
class Result:
    status: ModelServiceStatus
    plan: Plan
    events: list[tuple[str, str, str]]  # (type, reason, message)


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_spec(body: dict[str, Any]) -> ModelServiceSpec:
    try:
        return ModelServiceSpec.model_validate(body.get("spec") or {})
    except ValidationError as e:
        parts = [f"spec.{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors()]
        raise SpecInvalid("; ".join(parts)) from e


def parse_status(body: dict[str, Any]) -> ModelServiceStatus | None:
    raw = body.get("status")
    if not raw:
        return None
    try:
        return ModelServiceStatus.model_validate({k: v for k, v in raw.items() if k in _STATUS_KEYS})
    except ValidationError:
        return None  # written by an older operator: rebuilt from scratch


_STATUS_KEYS = {f.alias or name for name, f in ModelServiceStatus.model_fields.items()}


def _events(prev: ModelServiceStatus | None, new: ModelServiceStatus, the_plan: Plan,
            decision: a.Decision | None) -> list[tuple[str, str, str]]:
    out: list[tuple[str, str, str]] = []
    if any(isinstance(x, Apply) and x.reason == "create" and x.obj["kind"] == "Deployment" for x in the_plan.actions):
        out.append((NORMAL, "Created", f"created serving workload at serviceVersion {new.service_version}"))
    if the_plan.rollout and the_plan.rollout[0]:
        old, cur = the_plan.rollout
        out.append((NORMAL, "RolloutStarted", f"serviceVersion {old} -> {cur}: rolling the Deployment"))
    if the_plan.replicas:
        old_r, new_r = the_plan.replicas
        why = decision.message if decision is not None and decision.reason in (a.SCALED_UP, a.SCALED_DOWN) \
            else f"replicas {old_r} -> {new_r} (spec.replicas)"
        out.append((NORMAL, a.SCALED_UP if new_r > old_r else a.SCALED_DOWN, why))
    if decision is not None and decision.shed_reason in SHED_EVENTS:
        out.append((SHED_EVENTS[decision.shed_reason], decision.shed_reason, decision.shed_message))
    for c in st.transitions(prev, new):
        if c.type == st.DEGRADED and c.status == "True":
            out.append((WARNING, c.reason, c.message))
        elif c.type == st.QUANTIZATION_VALIDATED and c.reason in QUANTIZATION_EVENTS:
            out.append((QUANTIZATION_EVENTS[c.reason], "Quantization" + c.reason, c.message))
        elif c.type == st.SCALING and c.reason in SCALING_EVENTS:
            out.append((SCALING_EVENTS[c.reason], c.reason, c.message))
        elif c.type == st.PROGRESSING and c.reason == "RolloutComplete" and prev is not None:
            out.append((NORMAL, "RolloutComplete", c.message))
        elif c.type == st.READY and prev is not None:
            out.append((NORMAL if c.status == "True" else WARNING, c.reason, c.message))
    return out


def _finish(kube: Kube, body: dict[str, Any], prev: ModelServiceStatus | None, new: ModelServiceStatus,
            the_plan: Plan, decision: a.Decision | None) -> Result:
    events = _events(prev, new, the_plan, decision)
    meta = body["metadata"]
    if st.changed(prev, new):
        kube.patch_status(meta["namespace"], meta["name"], new.to_document())
    for type_, reason, message in events:
        log.info("%s/%s: event %s %s: %s", meta["namespace"], meta["name"], type_, reason, message)
        kube.post_event(body, type_, reason, message)
    return Result(new, the_plan, events)


def reconcile(kube: Kube, body: dict[str, Any], decision: a.Decision | None = None,
              pod_reports: tuple[q.PodReport, ...] | None = None) -> Result:
    """Bring the children in line with the spec (and `decision`, when the scale loop has one);
    `pod_reports` are the pods' /readyz answers when the scale loop read them this tick."""
    owner = Owner.from_body(body, operator_key())
    generation = body["metadata"].get("generation")
    prev = parse_status(body)
    try:
        spec = parse_spec(body)
    except SpecInvalid as e:
        running = kube.get("apps/v1", "Deployment", owner.namespace, n.deployment_name(owner.name))
        obs = st.Observed(deployment=running, desired_replicas=((running or {}).get("spec") or {}).get("replicas", 0),
                          service_version=prev.service_version if prev else "",
                          selector=n.selector_string(owner.name), invalid_spec=str(e))
        _finish(kube, body, prev, st.build(prev, generation, obs, None, now_iso()), Plan(), None)
        raise
    replicas = decision.replicas if decision is not None else desired_replicas(spec, prev)
    installation = installation_defaults()
    problems = tuple(unsupported(spec)) + tuple(installation.problems(spec))
    spec = installation.onto(spec)
    desired = build_all(owner, spec, replicas, service_monitor=kube.has_service_monitors(),
                        operator_namespace=operator_namespace())
    for obj in desired:
        if obj["kind"] == "ServiceMonitor":  # the labels kube-prometheus-stack's Prometheus selects on
            obj["metadata"]["labels"] = {**installation.service_monitor_labels, **obj["metadata"]["labels"]}
    absent = absent_children(owner, spec)
    observed = kube.observe(desired + absent)
    the_plan, apply_error, written = Plan(), None, {}
    if not problems:  # refused specs leave what runs untouched
        the_plan = plan(desired, observed, build_admin_secret(owner), absent)
        if decision is not None and decision.deletion_costs and the_plan.replicas:
            kube.set_deletion_costs(owner.namespace, decision.deletion_costs)  # before the ReplicaSet picks victims
        for action in the_plan.actions:
            obj = action.obj
            log.info("%s/%s: %s %s/%s", owner.namespace, owner.name,
                     getattr(action, "reason", type(action).__name__.lower()), obj["kind"], obj["metadata"]["name"])
        try:
            written = kube.execute(the_plan)
        except ApiError as e:
            if e.temporary:
                raise
            apply_error = str(e)
    deployment = written.get(("Deployment", n.deployment_name(owner.name))) or observed.get(
        ("Deployment", n.deployment_name(owner.name)))
    obs = st.Observed(deployment=deployment, desired_replicas=replicas, service_version=service_version(spec),
                      selector=n.selector_string(owner.name), problems=problems, apply_error=apply_error,
                      quantized=spec.quantization != "none", pod_reports=pod_reports)
    return _finish(kube, body, prev, st.build(prev, generation, obs, decision, now_iso()), the_plan, decision)
