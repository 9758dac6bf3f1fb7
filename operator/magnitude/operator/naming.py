"""Names, labels and annotations of the objects the operator makes for one ModelService.

One place, so builders, the plan, the API module, the scraper and the tests agree on them.
Pure: constants and string functions only.
"""

from __future__ import annotations

FIELD_MANAGER = "magnitude-operator"
LABEL_PREFIX = "serving.magnitude.dev"
LABEL_NAME = f"{LABEL_PREFIX}/modelservice"
LABEL_SERVICE_VERSION = f"{LABEL_PREFIX}/service-version"
ANNOTATION_CONFIG_HASH = f"{LABEL_PREFIX}/config-hash"
ANNOTATION_SERVICE_VERSION = f"{LABEL_PREFIX}/service-version"
POD_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"

ENGINE_PORT = 8000
ENGINE_PORT_NAME = "http"
CONFIG_DIR = "/etc/magnitude"
CONFIG_FILE = "engine.yaml"
ADMIN_TOKEN_KEY = "token"
ADMIN_TOKEN_ENV = "MAGNITUDE_ADMIN_TOKEN"
# The engine's root filesystem is read-only; these emptyDirs are the only places it writes.
CACHE_DIR = "/var/cache/magnitude"  # converted models (MAGNITUDE_CACHE), HF_HOME, XDG_CACHE_HOME
TMP_DIR = "/tmp"
# spec.auth: the engine's mode, and for apiKeys the keys Secret mounted as a whole folder (a subPath
# mount is never updated by the kubelet, and rotation must need no restart).
AUTH_MODE_ENV = "MAGNITUDE_AUTH_MODE"
API_KEYS_FILE_ENV = "MAGNITUDE_API_KEYS_FILE"
API_KEYS_VOLUME = "api-keys"
API_KEYS_DIR = "/etc/magnitude-auth"
API_KEYS_FILE = "keys.yaml"  # the engine parses JSON or YAML by content, not by name
NAMESPACE_LABEL = "kubernetes.io/metadata.name"  # set on every namespace by the API server


def selector_labels(name: str) -> dict[str, str]:
    """Labels that select a ModelService's pods; stable for its whole life."""
    return {"app.kubernetes.io/name": "magnitude-engine", LABEL_NAME: name}


def common_labels(name: str) -> dict[str, str]:
    """Labels every child object carries."""
    return {
        **selector_labels(name),
        "app.kubernetes.io/managed-by": FIELD_MANAGER,
        "app.kubernetes.io/part-of": "magnitude",
    }


def selector_string(name: str) -> str:
    """`status.selector`: the pod selector as the scale subresource wants it (a string)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def config_map_name(name: str) -> str:
    return f"{name}-engine-config"


def admin_secret_name(name: str, fingerprint: str) -> str:
    return f"{name}-admin-{fingerprint}"


def deployment_name(name: str) -> str:
    return name


def service_name(name: str) -> str:
    return name


def pdb_name(name: str) -> str:
    return name


def service_monitor_name(name: str) -> str:
    return name


def network_policy_name(name: str) -> str:
    return name
