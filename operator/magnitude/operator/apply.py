"""The only module that talks to the Kubernetes API.

Children are written with server-side apply under one field manager (Kopf has no SSA, so this
uses the kubernetes client's ApiClient with `application/apply-patch+yaml`), status with a merge
patch on the status subresource, Events as core/v1 Events. Every call goes through `Kube._call`,
which names the (group, resource, verb) it needs; `PERMISSIONS` lists them all, and the chart's
ClusterRole is checked against it (tests/operator/test_chart.py).

Every call has a deadline and a byte cap (`Kube(deadline=, max_bytes=)`): a silent or trickling
API server must not hold a service's reconcile lock, or a thread of the loop, for ever. The
socket timeouts cover connect and each read; the body is read in pieces against the deadline,
so the whole call ends within about the deadline plus one read timeout.
"""

from __future__ import annotations

import json
import secrets
import socket
import time
from datetime import datetime, timezone
from typing import Any

from magnitude.operator import naming as n
from magnitude.operator.plan import Apply, ChildKey, Create, Delete, Plan
from magnitude.operator.spec import API_VERSION, GROUP, KIND, PLURAL

# (apiVersion, kind) -> plural resource name, for every kind the operator touches.
RESOURCES: dict[tuple[str, str], str] = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Secret"): "secrets",
    ("v1", "Service"): "services",
    ("v1", "Pod"): "pods",
    ("v1", "Event"): "events",
    ("apps/v1", "Deployment"): "deployments",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitors",
    (API_VERSION, KIND): PLURAL,
}
SERVICE_MONITOR_GV = "monitoring.coreos.com/v1"
DISCOVERY_TTL_SECONDS = 60.0
# A reconcile makes a handful of calls; each one answers in milliseconds on a healthy API server.
API_DEADLINE_SECONDS = 15.0
API_CONNECT_SECONDS = 5.0
API_MAX_BYTES = 64 << 20  # a pod list of a large service is a few MiB
READ_PIECE_BYTES = 64 << 10

# Server-side apply of an object that does not exist yet creates it: the API server then checks
# `create` as well as `patch`, so every applied kind needs both.
APPLY_VERBS = frozenset({"get", "create", "patch"})
PERMISSIONS: dict[tuple[str, str], frozenset[str]] = {
    ("", "configmaps"): APPLY_VERBS,
    ("", "services"): APPLY_VERBS,
    ("apps", "deployments"): APPLY_VERBS,
    ("policy", "poddisruptionbudgets"): APPLY_VERBS,
    ("monitoring.coreos.com", "servicemonitors"): APPLY_VERBS,
    ("networking.k8s.io", "networkpolicies"): APPLY_VERBS | {"delete"},  # optional: deleted when turned off
    # The engines' admin token: only ever created (named after the token, never changed), so the
    # operator can neither read nor alter any Secret (a patch answers with the object it patched).
    ("", "secrets"): frozenset({"create"}),
    ("", "pods"): frozenset({"list", "patch"}),
    ("", "events"): frozenset({"create"}),
    (GROUP, f"{PLURAL}/status"): frozenset({"patch"}),
}
# What Kopf itself needs with scanning disabled and standalone mode (see handlers.configure):
# watch the resource, patch its annotations (progress, diff base), post events.
KOPF_PERMISSIONS: dict[tuple[str, str], frozenset[str]] = {
    (GROUP, PLURAL): frozenset({"list", "watch", "patch"}),
    ("", "events"): frozenset({"create"}),
}


class ApiError(Exception):
    """A failed API call; `temporary` says whether retrying may help."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def temporary(self) -> bool:
        return self.status is None or self.status in (409, 429) or self.status >= 500


def _split(api_version: str) -> tuple[str, str]:
    group, _, version = api_version.rpartition("/")
    return group, version


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Kube:
    """Typed helpers over one kubernetes ApiClient."""

    def __init__(self, api_client: Any = None, *, deadline: float = API_DEADLINE_SECONDS,
                 max_bytes: int = API_MAX_BYTES) -> None:
        self._api = api_client
        self.deadline = deadline
        self.max_bytes = max_bytes
        self._service_monitors: tuple[float, bool] | None = None  # (checked at, served)

    @classmethod
    def from_environment(cls) -> "Kube":
        """In-cluster config when running in a pod, else the current kubeconfig."""
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return cls(client.ApiClient())

    # -- the one place that performs HTTP -----------------------------------------------------
    def _http(self, method: str, path: str, params: list[tuple[str, str]] | None = None, body: Any = None,
              content_type: str = "application/json") -> tuple[int, Any]:
        """(status, decoded JSON body). Transport failures, a missed deadline and an answer over the
        byte cap raise ApiError(status=None)."""
        deadline = time.monotonic() + self.deadline
        try:
            method_, url, headers, body_, _ = self._api.param_serialize(
                method=method, resource_path=path, query_params=params or [],
                header_params={"Content-Type": content_type, "Accept": "application/json"},
                body=body, auth_settings=["BearerToken"])
            resp = self._api.call_api(method_, url, header_params=headers, body=body_,
                                      _request_timeout=(min(API_CONNECT_SECONDS, self.deadline), self.deadline))
            raw = self._read_body(resp.response, deadline)
        except ApiError as e:
            raise ApiError(f"{method} {path}: {e}") from e
        except OSError as e:  # connection refused, DNS, timeouts (urllib3 errors subclass it)
            raise ApiError(f"{method} {path}: {e}") from e
        except Exception as e:  # noqa: BLE001 - the client wraps transport errors in its own types
            raise ApiError(f"{method} {path}: {e}") from e
        try:
            data = json.loads(raw) if raw else None
        except ValueError:
            data = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        return resp.status, data

    def _read_body(self, response: Any, deadline: float) -> bytes:
        """The body of an urllib3 response, in pieces (`read1` returns what has arrived), so a
        trickle is cut at the deadline and an endless body at the cap. An aborted connection is
        closed, not returned to the pool half-read."""
        body = bytearray()
        done = False
        try:
            while True:
                if time.monotonic() > deadline:
                    raise ApiError(f"no complete answer within {self.deadline:g}s")
                piece = response.read1(READ_PIECE_BYTES)
                if not piece:
                    done = True
                    return bytes(body)
                body += piece
                if len(body) > self.max_bytes:
                    raise ApiError(f"answer is over the {self.max_bytes}-byte cap")
        finally:
            if done:
                response.release_conn()
            else:
                response.close()

    def _call(self, verb: str, api_version: str, resource: str, namespace: str | None, name: str | None = None,
              subresource: str | None = None, body: Any = None, params: list[tuple[str, str]] | None = None,
              content_type: str = "application/json") -> Any:
        group, version = _split(api_version)
        base = f"/apis/{group}/{version}" if group else f"/api/{version}"
        path = base + (f"/namespaces/{namespace}" if namespace else "") + f"/{resource}"
        if name:
            path += f"/{name}"
        if subresource:
            path += f"/{subresource}"
        method = {"get": "GET", "list": "GET", "create": "POST", "patch": "PATCH", "delete": "DELETE"}[verb]
        status, data = self._http(method, path, params, body, content_type)
        if verb in ("get", "delete") and status == 404:
            return None  # absent (or already gone)
        if status >= 400:
            detail = data.get("message") if isinstance(data, dict) else str(data)[:500]
            raise ApiError(f"{method} {path}: {status}: {detail}", status)
        return data

    # -- reads ------------------------------------------------------------------------------------
    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self._call("get", api_version, RESOURCES[(api_version, kind)], namespace, name)

    def observe(self, objs: list[dict[str, Any]]) -> dict[ChildKey, dict[str, Any] | None]:
        """Current state of each object named in `objs` (None: absent)."""
        out: dict[ChildKey, dict[str, Any] | None] = {}
        for obj in objs:
            meta = obj["metadata"]
            out[(obj["kind"], meta["name"])] = self.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        return out

    def has_service_monitors(self) -> bool:
        """Whether the Prometheus Operator's ServiceMonitor CRD is served (API discovery, no RBAC
        needed). Cached for a minute: every reconcile asks."""
        now = time.monotonic()
        if self._service_monitors is not None and now - self._service_monitors[0] < DISCOVERY_TTL_SECONDS:
            return self._service_monitors[1]
        served = self._discover_service_monitors()
        self._service_monitors = (now, served)
        return served

    def _discover_service_monitors(self) -> bool:
        try:
            status, found = self._http("GET", f"/apis/{SERVICE_MONITOR_GV}")
        except ApiError:
            return False
        if status != 200 or not isinstance(found, dict):
            return False
        return any(r.get("name") == "servicemonitors" for r in found.get("resources", []))

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        found = self._call("list", "v1", "pods", namespace, params=[("labelSelector", selector)])
        return list((found or {}).get("items", []))

    # -- writes -----------------------------------------------------------------------------------
    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return self._call("patch", obj["apiVersion"], RESOURCES[(obj["apiVersion"], obj["kind"])], meta["namespace"],
                          meta["name"], body=obj, params=[("fieldManager", n.FIELD_MANAGER), ("force", "true")],
                          content_type="application/apply-patch+yaml")

    def create(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        meta = obj["metadata"]
        try:
            return self._call("create", obj["apiVersion"], RESOURCES[(obj["apiVersion"], obj["kind"])],
                              meta["namespace"], body=obj, params=[("fieldManager", n.FIELD_MANAGER)])
        except ApiError as e:
            if e.status == 409:  # exists already: fine, it is never updated (its name says its content)
                return None
            raise

    def delete(self, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        self._call("delete", obj["apiVersion"], RESOURCES[(obj["apiVersion"], obj["kind"])], meta["namespace"],
                   meta["name"])

    def execute(self, the_plan: Plan) -> dict[ChildKey, dict[str, Any]]:
        """Run the plan's actions in order; returns the objects the server sent back."""
        written: dict[ChildKey, dict[str, Any]] = {}
        for action in the_plan.actions:
            if isinstance(action, Apply):
                written[(action.obj["kind"], action.obj["metadata"]["name"])] = self.apply(action.obj)
            elif isinstance(action, Create):
                self.create(action.obj)
            elif isinstance(action, Delete):
                self.delete(action.obj)
        return written

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self._call("patch", API_VERSION, PLURAL, namespace, name, subresource="status", body={"status": status},
                   content_type="application/merge-patch+json")

    def set_deletion_costs(self, namespace: str, costs: dict[str, int]) -> None:
        for pod, cost in costs.items():
            try:
                self._call("patch", "v1", "pods", namespace, pod,
                           body={"metadata": {"annotations": {n.POD_DELETION_COST: str(cost)}}},
                           content_type="application/merge-patch+json")
            except ApiError as e:
                if e.status != 404:  # the pod went away meanwhile: nothing to rank
                    raise

    def post_event(self, owner: dict[str, Any], type_: str, reason: str, message: str) -> None:
        meta = owner["metadata"]
        now = _now()
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{secrets.token_hex(8)}", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta.get("uid"),
                               "resourceVersion": meta.get("resourceVersion")},
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
            "source": {"component": n.FIELD_MANAGER},
            "reportingComponent": n.FIELD_MANAGER,
            "reportingInstance": socket.gethostname()[:128],
        }
        try:
            self._call("create", "v1", "events", meta["namespace"], body=event)
        except ApiError:
            pass  # an Event is best effort; never fail a reconcile over one
