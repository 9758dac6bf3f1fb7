"""Generates the ModelService CRD from the pydantic models in `spec.py` (one source).

The pydantic JSON schema is rewritten into a Kubernetes *structural* schema: `$ref`s are inlined,
`X | None` becomes `X` (plus `nullable` where null means something other than the default),
numeric exclusive bounds take the OpenAPI v3.0 boolean form, default-constructed objects and lists
get explicit defaults so the API server fills them in, and cross-field rules are added as CEL
`x-kubernetes-validations`. `render()` is what `magnitude crd` prints and `crds/modelservice.yaml` holds.
Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from magnitude.policy.schema import DNS_LABEL
from magnitude.operator.spec import (
    GROUP,
    PVC_SOURCE,
    RESERVED_ENV,
    RESERVED_ENV_PREFIX,
    RESERVED_LABEL_PREFIXES,
    KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    ModelServiceSpec,
    ModelServiceStatus,
)

# Cross-field rules, keyed by the pydantic class whose object they sit on. Each mirrors a
# model_validator in the pydantic models, so the API server refuses what the engine would.
CEL_RULES: dict[str, list[dict[str, str]]] = {
    "ModelServiceSpec": [
        {
            "rule": "self.minReplicas <= self.maxReplicas",
            "message": "minReplicas must be less than or equal to maxReplicas",
            "fieldPath": ".minReplicas",
        },
        {  # EngineConfig._check_swap_space
            "rule": "!has(self.scheduler) || !has(self.scheduler.preemptionMode) || self.scheduler.preemptionMode != 'swap'"
            " || (has(self.kvCache) && has(self.kvCache.swapBlocks) && self.kvCache.swapBlocks > 0)",
            "message": "scheduler.preemptionMode swap needs host swap space: kvCache.swapBlocks must be more than 0",
            "fieldPath": ".kvCache",
        },
    ],
    "DraftModelPolicy": [  # the same rules as DraftModelPolicy._check_method
        {
            "rule": "self.method != 'draft' || has(self.source)",
            "message": "draftModel.source is required for method draft",
            "fieldPath": ".source",
        },
        {
            "rule": "self.method != 'ngram' || (!has(self.source) && !has(self.revision))",
            "message": "draftModel.source and draftModel.revision apply to method draft only, not ngram",
            "fieldPath": ".method",
        },
        {
            "rule": "!has(self.revision) || (has(self.source) && self.source.startsWith('hf://'))",
            "message": "draftModel.revision applies only to hf:// sources",
            "fieldPath": ".revision",
        },
        {
            "rule": "!has(self.quantization) || self.quantization == 'none'"
            " || (has(self.method) && self.method == 'draft' && has(self.source) && !self.source.startsWith('self:'))",
            "message": "draftModel.quantization applies to a loaded draft model only, not ngram or self:N",
            "fieldPath": ".quantization",
        },
    ],
    "SchedulerPolicy": [
        {
            # type() guards an explicit null (both are nullable: null derives them on the engine).
            "rule": "!has(self.prefillChunkSize) || type(self.prefillChunkSize) != int"
            " || !has(self.tokenBudget) || type(self.tokenBudget) != int"
            " || self.prefillChunkSize <= self.tokenBudget",
            "message": "prefillChunkSize must be less than or equal to tokenBudget",
            "fieldPath": ".prefillChunkSize",
        },
        {
            "rule": "self.priorityClasses.exists(c, c.name == self.defaultPriorityClass)",
            "message": "defaultPriorityClass must be the name of one of the priorityClasses",
            "fieldPath": ".defaultPriorityClass",
        },
    ],
    "Auth": [
        {
            "rule": "self.mode == 'apiKeys' ? has(self.apiKeysSecretRef) : !has(self.apiKeysSecretRef)",
            "message": "apiKeysSecretRef is required when mode is apiKeys and not allowed with any other mode",
            "fieldPath": ".apiKeysSecretRef",
        },
    ],
    "ModelRef": [
        {
            "rule": "self.source.startsWith('hf://') || (!has(self.revision) && !has(self.tokenSecretRef))",
            "message": "revision and tokenSecretRef apply only to hf:// sources",
            "fieldPath": ".revision",
        },
        {
            "rule": f"!self.source.startsWith('pvc://') || self.source.matches('{PVC_SOURCE}')",
            "message": "a pvc:// source is pvc://CLAIM/PATH, CLAIM the name of a PersistentVolumeClaim",
            "fieldPath": ".source",
        },
    ],
    "ModelCache": [
        {
            "rule": "!(has(self.claimName) && has(self.sizeLimit))",
            "message": "claimName and sizeLimit exclude each other (sizeLimit is for the emptyDir)",
            "fieldPath": ".sizeLimit",
        },
    ],
    "Resources": [
        {
            "rule": "self.gpus <= 1",
            "message": "gpus above 1 needs tensor parallelism, which the engine does not have yet: use 0 or 1",
            "fieldPath": ".gpus",
        },
    ],
    "PodShape": [
        {
            "rule": f"self.env.all(e, !e.name.startsWith('{RESERVED_ENV_PREFIX}') && !(e.name in "
            f"[{', '.join(repr(v) for v in sorted(RESERVED_ENV))}]))",
            "message": f"env: {RESERVED_ENV_PREFIX}*, {', '.join(sorted(RESERVED_ENV))} are set by the operator "
            "from the spec's own fields",
            "fieldPath": ".env",
        },
        {
            "rule": "self.labels.all(k, " + " && ".join(f"!k.startsWith('{p}')" for p in RESERVED_LABEL_PREFIXES) + ")",
            "message": f"labels: the prefixes {', '.join(RESERVED_LABEL_PREFIXES)} belong to the operator",
            "fieldPath": ".labels",
        },
    ],
    "LoadShedding": [
        {
            "rule": "self.kvUsageOff <= self.kvUsageOn",
            "message": "kvUsageOff must be less than or equal to kvUsageOn (hysteresis)",
            "fieldPath": ".kvUsageOff",
        },
        {
            "rule": "self.queueTimeOffSeconds <= self.queueTimeOnSeconds",
            "message": "queueTimeOffSeconds must be less than or equal to queueTimeOnSeconds (hysteresis)",
            "fieldPath": ".queueTimeOffSeconds",
        },
    ],
}

# Lists whose items are keyed: the API server enforces unique keys and SSA merges per item.
LIST_MAP_KEYS: dict[tuple[str, str], list[str]] = {
    ("SchedulerPolicy", "priorityClasses"): ["name"],
    ("SchedulerPolicy", "tenantQuotas"): ["name"],
    ("ModelServiceStatus", "conditions"): ["type"],
}

# Defaults the API server must NOT fill in, so a CEL rule sees only what the user wrote: left out,
# the engine derives both from its measured cost model (a derived chunk never exceeds the derived
# budget), but an explicit chunk larger than an explicit budget is a mistake worth refusing.
NO_SERVER_DEFAULT: set[tuple[str, str]] = {("SchedulerPolicy", "prefillChunkSize"), ("SchedulerPolicy", "tokenBudget")}

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
    {"name": "Replicas", "type": "integer", "jsonPath": ".status.replicas"},
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.source"},
    {"name": "KV usage", "type": "number", "jsonPath": ".status.load.kvUsage"},
    {"name": "Queue", "type": "number", "jsonPath": ".status.load.queueTimeP90Seconds",
     "description": "Queue-time p90 in seconds over the last sync interval."},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

_COPIED_KEYS = ("type", "enum", "minimum", "maximum", "minLength", "maxLength", "pattern", "minItems",
                "maxItems", "minProperties", "maxProperties", "description", "format")


def _model_classes(root: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """Every pydantic class reachable from `root`, by name (the names `$defs` uses)."""
    found: dict[str, type[BaseModel]] = {}

    def visit(cls: type[BaseModel]) -> None:
        if cls.__name__ in found:
            return
        found[cls.__name__] = cls
        for field in cls.model_fields.values():
            for arg in _type_args(field.annotation):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    visit(arg)

    visit(root)
    return found


def _type_args(annotation: Any) -> list[Any]:
    args = list(getattr(annotation, "__args__", ()) or ())
    out = [annotation]
    for a in args:
        out.extend(_type_args(a))
    return out


def _field_default(field: FieldInfo) -> tuple[bool, Any]:
    """(has a default worth writing into the CRD, that default in wire form)."""
    if field.is_required():
        return False, None
    value = field.get_default(call_default_factory=True)
    if value is None:
        return False, None
    if isinstance(value, BaseModel):
        # The whole default object, not `{}`: the API server checks defaults against the CEL rules
        # without filling nested defaults first.
        return True, _wire(value)
    if isinstance(value, list):
        return True, [_wire(v) if isinstance(v, BaseModel) else v for v in value]
    return True, value


def _wire(model: BaseModel) -> dict[str, Any]:
    """A model's wire form without nulls and without the fields the server must not default."""
    doc = model.to_document()  # type: ignore[attr-defined]
    out: dict[str, Any] = {}
    for name, field in type(model).model_fields.items():
        alias = field.alias or name
        value = getattr(model, name)
        if value is None or (type(model).__name__, alias) in NO_SERVER_DEFAULT:
            continue
        if isinstance(value, BaseModel):
            out[alias] = _wire(value)
        elif isinstance(value, list):
            out[alias] = [_wire(v) if isinstance(v, BaseModel) else d for v, d in zip(value, doc[alias])]
        else:
            out[alias] = doc[alias]
    return out


class _Converter:
    def __init__(self, root: type[BaseModel], with_defaults: bool) -> None:
        self.schema = root.model_json_schema(by_alias=True, mode="validation")
        self.defs = self.schema.get("$defs", {})
        self.classes = _model_classes(root)
        self.with_defaults = with_defaults

    def root(self, cls: type[BaseModel]) -> dict[str, Any]:
        return self.obj(self.schema, cls)

    def obj(self, node: dict[str, Any], cls: type[BaseModel]) -> dict[str, Any]:
        by_alias = {(f.alias or name): f for name, f in cls.model_fields.items()}
        props: dict[str, Any] = {}
        required: list[str] = []
        for alias, sub in node.get("properties", {}).items():
            field = by_alias[alias]
            prop, null_ok = self.value(sub)
            has_default, default = _field_default(field)
            if field.is_required():
                required.append(alias)
            elif has_default and self.with_defaults and (cls.__name__, alias) not in NO_SERVER_DEFAULT:
                prop["default"] = default
            if null_ok and (has_default or (cls.__name__, alias) in NO_SERVER_DEFAULT):
                # null is a distinct choice from the default, or (no server default) an explicit "derive"
                prop["nullable"] = True
            keys = LIST_MAP_KEYS.get((cls.__name__, alias))
            if keys:
                prop["x-kubernetes-list-type"] = "map"
                prop["x-kubernetes-list-map-keys"] = keys
            props[alias] = prop
        out: dict[str, Any] = {"type": "object"}
        if cls.__doc__:
            out["description"] = " ".join(cls.__doc__.split())
        out["properties"] = props
        if required:
            out["required"] = required
        rules = CEL_RULES.get(cls.__name__)
        if rules:
            out["x-kubernetes-validations"] = [dict(r) for r in rules]
        return out

    def value(self, node: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """(structural schema, whether null is accepted)."""
        description = node.get("description")
        if "anyOf" in node:
            branches = [b for b in node["anyOf"] if b.get("type") != "null"]
            if len(branches) != 1:
                raise ValueError(f"only `X | None` unions map to a structural schema, got {node['anyOf']}")
            out, _ = self.value(branches[0])
            if description:
                out["description"] = description
            return out, len(branches) < len(node["anyOf"])
        if "$ref" in node:
            name = node["$ref"].rsplit("/", 1)[-1]
            out = self.obj(self.defs[name], self.classes[name])
            if description:
                out["description"] = description
            return out, False
        if node.get("type") == "object" and node.get("additionalProperties") is True:
            # dict[str, Any]: a Kubernetes type passed through (affinity, volumes); the API server
            # checks it when the operator applies the Deployment.
            out = {k: node[k] for k in _COPIED_KEYS if k in node}
            out["x-kubernetes-preserve-unknown-fields"] = True
            return out, False
        if node.get("type") == "object" and isinstance(node.get("additionalProperties"), dict):
            # A dict[str, X]: without `additionalProperties` the API server would prune every key.
            value, _ = self.value(node["additionalProperties"])
            out = {k: node[k] for k in _COPIED_KEYS if k in node}
            out["additionalProperties"] = value
            return out, False
        if node.get("type") == "array":
            item, _ = self.value(node["items"])
            out = {k: node[k] for k in _COPIED_KEYS if k in node}
            out["items"] = item
            return out, False
        out = {k: node[k] for k in _COPIED_KEYS if k in node}
        if "enum" in node and "type" not in node:
            out["type"] = "string"
        for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if bound in node:
                out[plain] = node[bound]
                out[bound] = True
        if out.get("pattern") == DNS_LABEL:
            out.setdefault("maxLength", 63)  # bounds CEL cost estimates; the pattern already implies it
        return out, False


def spec_schema() -> dict[str, Any]:
    """The structural OpenAPI v3 schema of `spec`."""
    return _Converter(ModelServiceSpec, with_defaults=True).root(ModelServiceSpec)


def status_schema() -> dict[str, Any]:
    """The structural schema of `status` (no defaults: the operator writes every field it owns)."""
    return _Converter(ModelServiceStatus, with_defaults=False).root(ModelServiceStatus)


def build() -> dict[str, Any]:
    """The CustomResourceDefinition object."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["magnitude"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A served model: engine policy, model, resources, scaling and shedding.",
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema(),
                                "status": status_schema(),
                            },
                            "required": ["spec"],
                        }
                    },
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": [dict(c) for c in PRINTER_COLUMNS],
                }
            ],
        },
    }


def render() -> str:
    """The CRD as YAML: exactly the bytes of `crds/modelservice.yaml`."""
    header = "# Generated by `magnitude crd` from operator/magnitude/operator/spec.py. Do not edit.\n"
    return header + yaml.safe_dump(build(), sort_keys=False, width=100, allow_unicode=True)
