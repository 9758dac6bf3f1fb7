"""spec.model and spec.modelCache onto the engine pod: the `--model` argument, the read-only
volume of a `pvc://` source, the hub token, the served name, and the cache volume's source.

`pvc://CLAIM/PATH` is the operator's: the claim is mounted read-only at /models/CLAIM and the
engine is given the plain path /models/CLAIM/PATH — for spec.model (`--model`) and for a
spec.draftModel source (the ConfigMap's draftModel.source; a second volume unless it is the same
claim). `hf://` sources go to the engine as written
(it downloads, pins and caches them); the revision travels as MAGNITUDE_MODEL_REVISION, which
`magnitude serve` reads as --revision, and the token as HF_TOKEN from the Secret (a secretKeyRef:
the operator never reads it). The cache volume (`cache`, mounted at MAGNITUDE_CACHE) is an
emptyDir, sized or not, or the PersistentVolumeClaim of spec.modelCache. Pure.
"""

from __future__ import annotations

from typing import Any

from magnitude.operator import naming as n
from magnitude.operator.spec import PVC_SCHEME, ModelServiceSpec

MODEL_SOURCE_VOLUME = "model-source"
DRAFT_SOURCE_VOLUME = "draft-source"
MODELS_DIR = "/models"


def pvc_source(source: str) -> tuple[str, str] | None:
    """(claim, path inside it) of a `pvc://claim/path` source, else None."""
    if not source.startswith(PVC_SCHEME):
        return None
    claim, _, path = source[len(PVC_SCHEME):].partition("/")
    return claim, path


def engine_path(source: str) -> str:
    """A source as the engine reads it: a pvc:// source becomes the path where its claim is mounted."""
    pvc = pvc_source(source)
    if pvc is None:
        return source
    claim, path = pvc
    return f"{MODELS_DIR}/{claim}/{path}".rstrip("/")


def model_arg(spec: ModelServiceSpec) -> str:
    """What `magnitude serve --model` gets."""
    return engine_path(spec.model.source)


def _claims(spec: ModelServiceSpec) -> list[tuple[str, str]]:
    """(volume, claim) for each pvc:// source: the model's, then the draft's unless in the same claim."""
    out: list[tuple[str, str]] = []
    model = pvc_source(spec.model.source)
    if model is not None:
        out.append((MODEL_SOURCE_VOLUME, model[0]))
    draft = pvc_source(spec.draft_model.source or "") if spec.draft_model is not None else None
    if draft is not None and (model is None or draft[0] != model[0]):
        out.append((DRAFT_SOURCE_VOLUME, draft[0]))
    return out


def serve_args(spec: ModelServiceSpec) -> list[str]:
    return ["--served-model-name", spec.model.served_model_name] if spec.model.served_model_name else []


def env(spec: ModelServiceSpec) -> list[dict[str, Any]]:
    ref = spec.model.token_secret_ref
    return [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}] if ref else []


def volumes(spec: ModelServiceSpec) -> list[dict[str, Any]]:
    return [{"name": name, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
            for name, claim in _claims(spec)]


def mounts(spec: ModelServiceSpec) -> list[dict[str, Any]]:
    return [{"name": name, "mountPath": f"{MODELS_DIR}/{claim}", "readOnly": True} for name, claim in _claims(spec)]


def cache_volume_source(spec: ModelServiceSpec) -> dict[str, Any]:
    """The source of the `cache` volume (mounted at n.CACHE_DIR, the engine's MAGNITUDE_CACHE)."""
    cache = spec.model_cache
    if cache.claim_name is not None:
        return {"persistentVolumeClaim": {"claimName": cache.claim_name}}
    return {"emptyDir": {"sizeLimit": cache.size_limit} if cache.size_limit else {}}


CACHE_VOLUME = "cache"
assert n.CACHE_DIR  # the mount path of CACHE_VOLUME
