"""Engine defaults of an installation: what the Helm chart's `engine` and `serviceMonitor` values
say every ModelService gets unless its spec says otherwise (image, image pull secrets, the two
security contexts, named resource profiles, and the labels kube-prometheus-stack selects
ServiceMonitors by). The chart passes them as JSON in MAGNITUDE_ENGINE_DEFAULTS; `onto()` folds
them into a spec before the pure builders run, so the builders see one effective spec.
Pure: pydantic only; reading the environment is `from_environment`'s one job.
"""

from __future__ import annotations

import json
import os

from pydantic import Field

from magnitude.operator.spec import (
    DEFAULT_ENGINE_IMAGE,
    FreeForm,
    LocalObjectReference,
    ModelServiceSpec,
    PodShape,
)
from magnitude.operator.validation import Problem
from magnitude.policy.schema import PolicyModel

ENV = "MAGNITUDE_ENGINE_DEFAULTS"


class EngineDefaults(PolicyModel):
    """The chart's engine defaults (values `engine.*` and `serviceMonitor.labels`)."""

    image: str = Field(default=DEFAULT_ENGINE_IMAGE, min_length=1)
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list)
    security_context: FreeForm = Field(default_factory=dict)
    container_security_context: FreeForm = Field(default_factory=dict)
    profiles: dict[str, PodShape] = Field(default_factory=dict)
    service_monitor_labels: dict[str, str] = Field(default_factory=dict)

    def problems(self, spec: ModelServiceSpec) -> list[Problem]:
        name = spec.pod.profile
        if name is not None and name not in self.profiles:
            known = ", ".join(sorted(self.profiles)) or "none"
            return [Problem("spec.pod.profile", f"no resource profile {name} in this installation (known: {known}; "
                            "the Helm value engine.profiles defines them)")]
        return []

    def onto(self, spec: ModelServiceSpec) -> ModelServiceSpec:
        """The spec with these defaults under it: a field the spec fills wins, key by key for the
        security contexts; an unknown profile adds nothing (see `problems`)."""
        base = self.profiles.get(spec.pod.profile or "", PodShape()).to_document()
        own = spec.pod.to_document()
        doc = {key: value if value not in (None, {}, [], False) else base[key] for key, value in own.items()}
        doc["imagePullSecrets"] = doc["imagePullSecrets"] or [r.to_document() for r in self.image_pull_secrets]
        for key, ours in (("securityContext", self.security_context),
                          ("containerSecurityContext", self.container_security_context)):
            doc[key] = {**ours, **(base[key] or {}), **(own[key] or {})} or None
        pod = PodShape.model_validate(doc)
        return spec.model_copy(update={"image": spec.image or self.image, "pod": pod})


def from_environment() -> EngineDefaults:
    """The installation's defaults (MAGNITUDE_ENGINE_DEFAULTS, JSON), or the built-in ones."""
    raw = os.environ.get(ENV, "").strip()
    return EngineDefaults.model_validate(json.loads(raw)) if raw else EngineDefaults()
