"""The quantization evaluation record, from the engine pods' /readyz to the ModelService status, and
pods that will not become ready no longer holding the autoscaler (issues 10 and 11).

The pods live on the real kube-apiserver (opkit, made from the operator's own pod template); a
loopback HTTP server answers each pod's /readyz and /metrics (MAGNITUDE_OPERATOR_POD_URL points
the operator at it); everything else is the operator's code: one `loop.tick` lists the pods,
reads them, decides, reconciles and writes status and Events. The judging itself is pure and
table-tested at the end."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from kubernetes import client as k8s

from magnitude.operator import loop, scrape
from magnitude.operator import quantization as q
from magnitude.operator import status as st
from magnitude.operator.reconcile import reconcile
from opkit import NAME, Env
from test_scrape import engine, engine_text

READY_METRICS = engine_text(engine(running=1, waiting=0, used=10))
FULL_METRICS = engine_text(engine(running=4, waiting=0, used=100))  # KV usage 1.0


def record(passed: bool = True, enforced: bool = True, failures: tuple[str, ...] = ()) -> dict[str, Any]:
    """A record as the engine's /readyz shows it (magnitude.engine.quantization.summary)."""
    return {"method": "w8a16", "passed": passed, "enforced": enforced, "failures": list(failures),
            "top1_agreement": 0.9712, "mean_kl": 0.00421, "probes_passed": 4, "probes_total": 4,
            "probes": [{"name": "capital", "passed": True, "reference_passed": True}], "eval_tokens": 512,
            "eval_set_hash": "3f2a", "isa": "AVX2", "torch_version": "2.5.1", "dtype": "float32", "cached": False}


def ready_answer(rec: dict[str, Any] | None) -> tuple[int, dict[str, Any]]:
    return 200, {"status": "ready", "model": "m", **({"quantization": rec} if rec else {})}


def not_ready_answer(phase: str, rec: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    return 503, {"status": "not_ready", "phase": phase, "progress": 1.0, "message": "...",
                 **({"quantization": rec} if rec else {})}


class Engines:
    """Engine pods on one loopback server: GET /<pod>/readyz and /<pod>/metrics answer what the test
    put in `readyz` and `metrics`; a pod without an entry refuses nothing but answers 404."""

    def __init__(self) -> None:
        self.readyz: dict[str, tuple[int, dict[str, Any]]] = {}
        self.metrics: dict[str, str] = {}
        self.asked: list[str] = []
        engines = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server API
                engines.asked.append(self.path)
                pod, _, what = self.path.strip("/").partition("/")
                if what == "readyz" and pod in engines.readyz:
                    code, doc = engines.readyz[pod]
                    body, kind = json.dumps(doc).encode(), "application/json"
                elif what == "metrics" and pod in engines.metrics:
                    code, body, kind = 200, engines.metrics[pod].encode(), "text/plain"
                else:
                    code, body, kind = 404, b"{}", "application/json"
                self.send_response(code)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url_template(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/{{name}}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch) -> Iterator[Engines]:
    e = Engines()
    monkeypatch.setenv(scrape.URL_TEMPLATE_ENV, e.url_template)
    yield e
    e.close()


def tick(api: Env, entry: loop.Entry | None = None) -> loop.Entry:
    """One scale-loop tick, with the body a watch would have delivered."""
    entry = entry or loop.Entry(body=api.current())
    entry.body = api.current()

    async def go() -> None:
        async with httpx.AsyncClient() as client:
            await loop.tick(api.kube, entry, client)
    asyncio.run(go())
    return entry


def events(api: Env) -> list[tuple[str, str, str]]:
    return [(e["type"], e["reason"], e["message"]) for e in api.events()]


def quantized(api: Env, **spec: Any) -> None:
    reconcile(api.kube, api.body(quantization="w8a16", **spec))


# ---- the condition on the real API server ----------------------------------------------------------

def test_a_passing_record_validates_the_quantization_with_its_numbers(api: Env, engines: Engines) -> None:
    quantized(api)
    api.add_pod("p0", "10.0.0.1")
    engines.readyz["p0"], engines.metrics["p0"] = ready_answer(record()), READY_METRICS
    tick(api)
    cond = api.cond(st.QUANTIZATION_VALIDATED)
    assert (cond["status"], cond["reason"]) == ("True", q.PASSED), cond
    for figure in ("w8a16", "top-1 agreement 0.971", "mean KL 0.0042", "probes 4/4", "ISA AVX2"):
        assert figure in cond["message"], cond["message"]
    assert ("Normal", "QuantizationPassed", cond["message"]) in events(api)
    assert api.cond("Degraded")["status"] == "False"
    assert "/p0/readyz" in engines.asked  # a ready pod of a quantized service is asked for its record


def test_a_rejected_pod_degrades_the_service_with_the_numbers_and_an_event(api: Env, engines: Engines) -> None:
    """The pod is not ready (the engine refused its weights): today the operator never asks a
    not-ready pod anything, so nothing in the status says why the service does not come up."""
    quantized(api, quantizationEvaluation={"minTop1Agreement": 0.999})
    api.add_pod("p0", "10.0.0.1", ready=False)
    failed = "top-1 agreement 0.971 < minTop1Agreement 0.999"
    engines.readyz["p0"] = not_ready_answer(q.PHASE_REJECTED, record(passed=False, failures=(failed,)))
    entry = tick(api)
    cond, degraded = api.cond(st.QUANTIZATION_VALIDATED), api.cond("Degraded")
    assert (cond["status"], cond["reason"]) == ("False", q.REJECTED), cond
    assert (degraded["status"], degraded["reason"]) == ("True", st.QUANTIZATION_REJECTED), degraded
    for text in ("pod(s) p0", "top-1 agreement 0.971", "probes 4/4", failed):
        assert text in degraded["message"], degraded["message"]
    assert [(t, r) for t, r, _ in events(api) if r.startswith("Quantization")] == [("Warning", "QuantizationRejected")]
    # A change handler's reconcile (no pods read) keeps the verdict: no flap, no new Events.
    before = len(api.events())
    reconcile(api.kube, api.current())
    assert api.cond("Degraded")["reason"] == st.QUANTIZATION_REJECTED and len(api.events()) == before
    # The engine passes after a threshold change (new pods): the service recovers and says so.
    engines.readyz["p0"] = ready_answer(record())
    api.core.patch_namespaced_pod_status("p0", api.ns, {"status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    engines.metrics["p0"] = READY_METRICS
    tick(api, entry)
    assert api.cond(st.QUANTIZATION_VALIDATED)["reason"] == q.PASSED and api.cond("Degraded")["status"] == "False"


def test_a_failed_record_served_anyway_is_a_warning_not_degraded(api: Env, engines: Engines) -> None:
    quantized(api, quantizationEvaluation={"minTop1Agreement": 0.999, "enforce": False})
    api.add_pod("p0", "10.0.0.1")
    failed = "top-1 agreement 0.971 < minTop1Agreement 0.999"
    engines.readyz["p0"] = ready_answer(record(passed=False, enforced=False, failures=(failed,)))
    engines.metrics["p0"] = READY_METRICS
    tick(api)
    cond = api.cond(st.QUANTIZATION_VALIDATED)
    assert (cond["status"], cond["reason"]) == ("False", q.FAILED_NOT_ENFORCED), cond
    assert "enforce is false" in cond["message"] and failed in cond["message"] and "p0" in cond["message"]
    assert ("Warning", "QuantizationFailedNotEnforced", cond["message"]) in events(api)
    assert api.cond("Degraded")["status"] == "False"  # served on purpose: the user chose it


def test_pending_until_a_pod_reports_and_absent_without_quantization(api: Env, engines: Engines) -> None:
    quantized(api)
    api.add_pod("p0", "10.0.0.1", ready=False)
    engines.readyz["p0"] = not_ready_answer("loading")  # still evaluating: no record yet
    tick(api)
    cond = api.cond(st.QUANTIZATION_VALIDATED)
    assert (cond["status"], cond["reason"]) == ("Unknown", q.PENDING), cond
    assert api.cond("Scaling")["reason"] != "PodsStuck"  # loading, inside the load timeout
    reconcile(api.kube, api.body(quantization="none"))  # full precision: nothing to validate
    tick(api)
    assert st.QUANTIZATION_VALIDATED not in {c["type"] for c in api.status()["conditions"]}


# ---- pods that will not become ready no longer hold scale-up (issue 11) ----------------------------

def not_ready_since(api: Env, pod: str, when: datetime) -> None:
    """What the kubelet reports for a pod that has failed readiness since `when`."""
    stamp = when.strftime("%Y-%m-%dT%H:%M:%SZ")
    k8s.CoreV1Api(api.server.admin).patch_namespaced_pod_status(pod, api.ns, {"status": {"conditions": [
        {"type": "Ready", "status": "False", "lastTransitionTime": stamp}]}})


@pytest.mark.parametrize("stuck, why", [
    ("rejected", "/readyz phase quantization_rejected"),
    ("failed", "/readyz phase failed"),
    ("loading for an hour", "past spec.modelLoadTimeoutSeconds 60"),
    ("loading just now", None),  # the control: a pod on its way still holds scale-up
])
def test_a_pod_that_will_not_become_ready_no_longer_holds_scale_up(api: Env, engines: Engines, stuck: str,
                                                                   why: str | None) -> None:
    reconcile(api.kube, api.body(replicas=2, minReplicas=1, maxReplicas=4, modelLoadTimeoutSeconds=60,
                                 autoscaling={"enabled": True, "targetKvUsage": 0.3}))
    api.add_pod("p0", "10.0.0.1")
    engines.readyz["p0"], engines.metrics["p0"] = ready_answer(None), FULL_METRICS  # ratio 1.0/0.3: wants 4
    api.add_pod("p1", "10.0.0.2", ready=False)
    phase = {"rejected": q.PHASE_REJECTED, "failed": "failed"}.get(stuck, "loading")
    engines.readyz["p1"] = not_ready_answer(phase)
    if stuck == "loading for an hour":
        not_ready_since(api, "p1", datetime.now(timezone.utc) - timedelta(hours=1))
    tick(api)
    scaling = api.cond("Scaling")
    if why is None:
        assert scaling["reason"] == "PodsPending" and api.get("Deployment")["spec"]["replicas"] == 2, scaling
        return
    assert scaling["reason"] == "ScaledUp" and api.get("Deployment")["spec"]["replicas"] == 4, scaling
    assert "not waiting for pod p1 (" in scaling["message"] and why in scaling["message"], scaling["message"]


def test_only_stuck_pods_hold_the_size_with_a_warning_naming_them(api: Env, engines: Engines) -> None:
    reconcile(api.kube, api.body(replicas=1, maxReplicas=3, autoscaling={"enabled": True}))
    api.add_pod("p0", "10.0.0.1", ready=False)
    engines.readyz["p0"] = not_ready_answer("dead")
    tick(api)
    scaling = api.cond("Scaling")
    assert scaling["reason"] == "PodsStuck" and "pod p0 (/readyz phase dead)" in scaling["message"], scaling
    assert ("Warning", "PodsStuck") in [(t, r) for t, r, _ in events(api)]


# ---- the judging, pure ---------------------------------------------------------------------------

REC = q.parse_record(record())
FAILED = q.parse_record(record(passed=False, failures=("mean KL 0.0042 > maxMeanKl 0.001",)))


@pytest.mark.parametrize("reports, reason", [
    ((), q.PENDING),
    ((q.PodReport("a", phase="loading"),), q.PENDING),
    ((q.PodReport("a", record=REC),), q.PASSED),
    ((q.PodReport("a", record=REC), q.PodReport("b", record=FAILED)), q.FAILED_NOT_ENFORCED),
    # One pod rejected (another CPU, other kernels) is enough: its pods cannot serve.
    ((q.PodReport("a", record=REC), q.PodReport("b", phase=q.PHASE_REJECTED, record=FAILED)), q.REJECTED),
])
def test_judge(reports: tuple[q.PodReport, ...], reason: str) -> None:
    verdict = q.judge(reports)
    assert verdict.reason == reason
    assert (verdict.degraded is not None) == (reason == q.REJECTED)


def test_a_tick_without_records_keeps_the_verdict_until_the_spec_changes() -> None:
    """A pod briefly unreachable must not flip Passed to Pending and back (an Event each time)."""
    def build(prev: st.ModelServiceStatus | None, generation: int, reports: tuple[q.PodReport, ...] | None,
              ) -> st.ModelServiceStatus:
        obs = st.Observed(deployment=None, desired_replicas=1, service_version="v", selector="s", quantized=True,
                          pod_reports=reports)
        return st.build(prev, generation, obs, None, "2026-01-01T00:00:00Z")

    def reason(s: st.ModelServiceStatus) -> str:
        return next(c.reason for c in s.conditions if c.type == st.QUANTIZATION_VALIDATED)
    passed = build(None, 1, (q.PodReport("a", record=REC),))
    assert reason(passed) == q.PASSED
    assert reason(build(passed, 1, ())) == q.PASSED and st.transitions(passed, build(passed, 1, ())) == []
    assert reason(build(passed, 1, None)) == q.PASSED
    assert reason(build(passed, 2, ())) == q.PENDING  # a new spec: the old verdict says nothing about it


@pytest.mark.parametrize("garbage", [
    None, [], "passed", {"method": "w8a16"}, {**record(), "top1_agreement": "NaN"}, {**record(), "mean_kl": float("inf")},
    {**record(), "passed": "yes"}, {**record(), "probes_total": None}, {**record(), "failures": "all"},
])
def test_a_malformed_record_counts_as_none(garbage: Any) -> None:
    assert q.parse_record(garbage) is None
