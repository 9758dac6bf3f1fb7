"""Issue 11's chaos scenario: faults injected into a running fleet on the real control plane,
with the real operator (under the chart's RBAC) and a real engine process behind every pod.

a. An engine process is SIGKILLed mid-stream: the stand-in kubelet restarts its container (same
   pod, restartCount 1, Ready again) and streams on the service's other pod run to completion.
b. One pod's /metrics serves garbage, then nothing (the stand-in's `FaultProxy`, a test hook in
   front of that pod's engine, not a Kubernetes feature): the operator names the pod and why in
   the Scaling condition and a Warning Event, and keeps reconciling: a second ModelService's spec
   change converges, and a hand edit of either service's Deployment (which only the scale loop's
   ticks correct) is taken back while the pod misbehaves.
c. `kubectl set env deployment/NAME INJECTED=1` (another field manager): the operator leaves the
   foreign entry alone and does not write the Deployment again (PATCHes counted in the API
   server's audit log); an edit of a field it owns is taken back once, then nothing.

Every engine runs `--runner simulated` (the real server, scheduler and metrics; a cost model for
the forward pass). Each test prints the figures it measured (`pytest -s` shows them).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter

import httpx

from conftest import condition, wait_for
from kubelet import MetricsFault
from load import CUT, Load
from test_modelservice import NS, debug, delete_and_wait, events, msvc, pods, ready_msvc, sim_service

# The operator's scale loop ticks every 2 s in this suite (conftest.OPERATOR_ENV).
TICK_SECONDS = float(os.environ.get("MAGNITUDE_E2E_TICK_SECONDS", "2"))


def pod_url(pod: dict) -> str:
    return f"http://{pod['status']['podIP']}:8000"


def gauge(url: str, name: str) -> float:
    """One unlabelled gauge from an engine's /metrics (0 when absent)."""
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def restart_count(pod: dict) -> int:
    statuses = pod["status"].get("containerStatuses") or []
    return statuses[0].get("restartCount", 0) if statuses else 0


def is_ready(pod: dict) -> bool:
    return (condition(pod, "Ready") or {}).get("status") == "True"


def operator_user(kube, operator) -> str:
    whoami = kube.run("--kubeconfig", str(operator.kubeconfig), "auth", "whoami", "-o", "json")
    return json.loads(whoami.stdout)["status"]["userInfo"]["username"]


def deployment_writes(cluster, since: int, user: str, name: str) -> list[dict]:
    """Writes (patch/update/create) by `user` to Deployment `name` answered after audit offset `since`."""
    return [e for e in cluster.audit_events(since=since)
            if e.get("user", {}).get("username") == user and e.get("verb") in ("patch", "update", "create")
            and (e.get("objectRef") or {}).get("resource") == "deployments"
            and (e.get("objectRef") or {}).get("name") == name and not (e.get("objectRef") or {}).get("subresource")]


def settled(kube, name: str) -> dict | None:
    """The Deployment once its rollout is complete (every replica updated and ready, nothing extra)."""
    d = kube.get("deployment", name)
    s, want = d.get("status", {}), d["spec"]["replicas"]
    done = (s.get("observedGeneration") == d["metadata"]["generation"] and s.get("updatedReplicas") == want
            and s.get("readyReplicas") == want and s.get("replicas") == want
            and len(pods(kube, name, ready_only=True)) == want == len(pods(kube, name)))
    return d if done else None


def surge(kube, name: str) -> object:
    return kube.get("deployment", name)["spec"]["strategy"]["rollingUpdate"]["maxSurge"]


def hand_edit_surge(kube, name: str, value: int) -> None:
    """Change a Deployment field the operator owns (no pod churn: not in the pod template)."""
    kube.run("patch", "deployment", name, "-n", NS, "--type", "merge", "--field-manager", "hand-edit",
             "-p", json.dumps({"spec": {"strategy": {"rollingUpdate": {"maxSurge": value}}}}))


# -- a. kill an engine mid-stream ------------------------------------------------------------
def test_a_engine_killed_mid_stream_is_restarted_and_other_streams_are_untouched(kube, operator, kubelet) -> None:
    name = "chaos-kill"
    kube.apply(sim_service(name, replicas=2))
    ready_msvc(kube, operator, kubelet, name, timeout=120, replicas=2)
    dump = debug(kube, operator, kubelet, name)
    victim, other = sorted(pods(kube, name, ready_only=True), key=lambda p: p["metadata"]["name"])
    key = f"{NS}/{victim['metadata']['name']}"
    # One long stream on the victim; short streams keep coming on the other pod all along.
    doomed = Load(lambda: [pod_url(victim)], concurrency=1, max_tokens=400, max_seconds=120, stream=True).start()
    bystanders = Load(lambda: [pod_url(other)], concurrency=3, max_tokens=48, max_seconds=150, stream=True).start()
    try:
        wait_for("streams running on both pods", lambda: gauge(pod_url(victim), "magnitude_requests_running") >= 1
                 and gauge(pod_url(other), "magnitude_requests_running") >= 1, 30, on_timeout=dump)
        pid = kubelet.engines[key].proc.pid
        os.kill(pid, signal.SIGKILL)  # the process alone, as a crash or the OOM killer would
        wait_for("the victim's stream to end", lambda: doomed.statuses, 30, on_timeout=dump)
        doomed.stop()

        def restarted() -> dict | None:
            now = next((p for p in pods(kube, name) if p["metadata"]["name"] == victim["metadata"]["name"]), None)
            return now if now and restart_count(now) == 1 and is_ready(now) else None
        back = wait_for("the killed container restarted and Ready again", restarted, 90, on_timeout=dump)
        assert back["metadata"]["uid"] == victim["metadata"]["uid"], "the pod was replaced, not restarted"
        assert kubelet.engines[key].proc.pid != pid
        ready_msvc(kube, operator, kubelet, name, timeout=60, replicas=2)
    finally:
        bystanders.stop()
        doomed.stop()
    # The stream on the killed engine did not finish; the restarted engine serves again.
    assert 200 not in doomed.statuses, doomed.statuses
    again = Load(lambda: [pod_url(victim)], concurrency=1, max_tokens=8, max_seconds=30, stream=True).start()
    wait_for("a stream served by the restarted engine", lambda: again.statuses[200], 30, on_timeout=dump)
    again.stop()
    # Every stream on the other pod, before, during and after the fault, ran to [DONE].
    other_5xx = sum(n for s, n in bystanders.statuses.items() if isinstance(s, int) and s >= 500)
    assert bystanders.statuses[200] > 0 and set(bystanders.statuses) == {200}, bystanders.statuses
    print(f"\nchaos a: faults injected 1 (SIGKILL pid {pid} of {key} mid-stream); victim streams "
          f"{dict(doomed.statuses)} (cut or refused, {CUT!r} = ended without [DONE]); restarts observed "
          f"{restart_count(back)}; streams on the other pod {dict(bystanders.statuses)}, 5xx {other_5xx}")
    delete_and_wait(kube, name)


# -- b. garbage, then nothing, from one pod's /metrics ---------------------------------------
def test_b_bad_metrics_pod_is_named_and_every_service_keeps_reconciling(kube, operator, kubelet) -> None:
    bad, calm = "chaos-metrics", "chaos-bystander"
    fault = kubelet.metrics_faults[bad] = MetricsFault()
    try:
        # Autoscaling on: the Scaling condition then judges the pods' metrics (off, spec.replicas decides).
        kube.apply(sim_service(bad, replicas=1, minReplicas=1, maxReplicas=1, autoscaling={
            "enabled": True, "metricsMaxAgeSeconds": 6}))
        kube.apply(sim_service(calm, replicas=1))
        ready_msvc(kube, operator, kubelet, bad, timeout=120, replicas=1)
        ready_msvc(kube, operator, kubelet, calm, timeout=120, replicas=1)
        dump = debug(kube, operator, kubelet, bad)
        pod = pods(kube, bad)[0]["metadata"]["name"]
        wait_for("healthy metrics first", lambda: (condition(msvc(kube, bad), "Scaling") or {}).get("reason")
                 not in (None, "MetricsUnavailable"), 30, on_timeout=dump)

        def marked(why: str):
            def probe() -> dict | None:
                c = condition(msvc(kube, bad), "Scaling") or {}
                return c if c.get("reason") == "MetricsUnavailable" and pod in c["message"] and why in c["message"] \
                    else None
            return probe

        fault.set("garbage")
        garbage = wait_for("Scaling names the pod serving garbage", marked("non-finite"), 30, on_timeout=dump)
        event = wait_for("a Warning Event naming the pod", lambda: [
            e for e in events(kube, bad) if e["type"] == "Warning" and e["reason"] == "MetricsUnavailable"
            and pod in e["message"]], 30, on_timeout=dump)[0]
        fault.set("silent")
        silent = wait_for("Scaling names the pod that does not answer", marked("no complete answer"), 30,
                          on_timeout=dump)

        # Meanwhile every service goes on being reconciled: a spec change of the other one rolls out...
        before = msvc(kube, calm)
        kube.apply(sim_service(calm, replicas=1, scheduler={"tokenBudget": 512}))

        def converged() -> dict | None:
            ms = msvc(kube, calm)
            st = ms.get("status", {})
            fresh = [p for p in pods(kube, calm, ready_only=True)
                     if p["metadata"]["labels"].get("serving.magnitude.dev/service-version") == st.get("serviceVersion")]
            return ms if (st.get("observedGeneration") == ms["metadata"]["generation"]
                          and st.get("serviceVersion") != before["status"]["serviceVersion"]
                          and len(fresh) == 1 and settled(kube, calm)
                          and (condition(ms, "Ready") or {}).get("status") == "True") else None
        wait_for("the other ModelService's spec change to converge", converged, 120,
                 on_timeout=debug(kube, operator, kubelet, calm))
        # ...and hand edits of both Deployments, which only the scale loop's ticks see, are taken back.
        for name in (calm, bad):
            hand_edit_surge(kube, name, 4)
        for name in (calm, bad):
            wait_for(f"the tick to take {name}'s maxSurge back", lambda: surge(kube, name) == 1, 30,
                     on_timeout=debug(kube, operator, kubelet, name))
        still = condition(msvc(kube, bad), "Scaling") or {}
        assert still.get("reason") == "MetricsUnavailable" and pod in still["message"], still
        assert all(is_ready(p) for p in pods(kube, bad)), "the pod's readiness went with its metrics"
        faults_served = fault.metrics_requests
        fault.set("pass")
        wait_for("the pod's metrics count again", lambda: (condition(msvc(kube, bad), "Scaling") or {}).get("reason")
                 != "MetricsUnavailable", 30, on_timeout=dump)
    finally:
        fault.set("pass")
        kubelet.metrics_faults.pop(bad, None)
    print(f"\nchaos b: faults injected 2 (garbage, then silence, on {pod}'s /metrics: {faults_served} scrapes "
          f"met a fault); Scaling said {garbage['message']!r} then {silent['message']!r}; Event "
          f"{event['reason']}: {event['message']!r}; {calm} rolled to a new serviceVersion and both "
          f"Deployments' hand edits were taken back while the pod misbehaved")
    delete_and_wait(kube, bad)
    delete_and_wait(kube, calm)


# -- c. a foreign env entry, by hand --------------------------------------------------------
def test_c_foreign_env_entry_converges_without_a_hot_loop(kube, cluster, operator, kubelet) -> None:
    name = "chaos-drift"
    kube.apply(sim_service(name, replicas=1))
    ready_msvc(kube, operator, kubelet, name, timeout=120, replicas=1)
    dump = debug(kube, operator, kubelet, name)
    user = operator_user(kube, operator)
    wait_for("the Deployment settled", lambda: settled(kube, name), 60, on_timeout=dump)
    mark = cluster.audit_size()
    kube.run("set", "env", f"deployment/{name}", "-n", NS, "INJECTED=1")  # field manager kubectl-set
    wait_for("the hand-edited rollout to finish", lambda: settled(kube, name), 90, on_timeout=dump)
    d = kube.get("deployment", name)
    version = d["metadata"]["resourceVersion"]
    # A few ticks: the operator plans nothing for an entry it does not own, so nothing is written.
    time.sleep(5 * TICK_SECONDS)
    d2 = kube.get("deployment", name)
    foreign_writes = deployment_writes(cluster, mark, user, name)
    env = {e["name"]: e.get("value") for e in d2["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env.get("INJECTED") == "1", "the operator removed an entry another manager owns"
    assert "MAGNITUDE_SERVICE_VERSION" in env and "MAGNITUDE_QUANTIZATION" in env, env
    assert d2["metadata"]["resourceVersion"] == version, "the Deployment kept changing after the rollout"
    assert not foreign_writes, f"the operator wrote the Deployment {len(foreign_writes)} times for a foreign entry"
    assert is_ready(pods(kube, name)[0])
    # A field the operator owns is taken back once, and then left alone.
    mark = cluster.audit_size()
    hand_edit_surge(kube, name, 3)
    wait_for("the owned field taken back", lambda: surge(kube, name) == 1, 30, on_timeout=dump)
    corrected = len(deployment_writes(cluster, mark, user, name))
    version = kube.get("deployment", name)["metadata"]["resourceVersion"]
    mark = cluster.audit_size()
    time.sleep(5 * TICK_SECONDS)
    after = deployment_writes(cluster, mark, user, name)
    assert corrected == 1, f"{corrected} writes to take one field back"
    assert not after, f"{len(after)} more writes after the owned field was taken back"
    assert kube.get("deployment", name)["metadata"]["resourceVersion"] == version
    verbs = Counter(e["verb"] for e in foreign_writes + after)
    print(f"\nchaos c: faults injected 2 (kubectl set env INJECTED=1; maxSurge 1 -> 3 by hand); operator writes "
          f"to the Deployment over {5 * TICK_SECONDS:g} s after each: {len(foreign_writes)} and {len(after)} "
          f"({dict(verbs)}); writes to take the owned field back: {corrected}; INJECTED kept")
    delete_and_wait(kube, name)
