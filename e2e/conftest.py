"""Fixtures for the end-to-end suite: one local control plane per session, a kubelet for
kwok pods, and helpers to apply manifests and wait for conditions.

Without the control-plane binaries the suite skips with a clear message; under CI=true a
skip is a failure, so CI cannot go green without having run it.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from cluster import BIN, Cluster, ClusterError, processes_mentioning, require_control_plane
from kubelet import Kubelet

E2E = Path(__file__).resolve().parent
REPO = E2E.parent
STATE = E2E / ".state"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if E2E in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    require_control_plane()
    # Audited: the chaos scenario counts the operator's writes (a no-op PATCH changes nothing else).
    c = Cluster(state=STATE / f"cluster-{os.getpid()}", audit=True)
    try:
        c.start()
    except ClusterError as err:
        pytest.fail(str(err), pytrace=False)
    yield c
    c.stop()
    leaked = processes_mentioning(c.state)
    if leaked:
        pytest.fail(f"processes left running after teardown: {leaked}", pytrace=False)
    if not os.environ.get("E2E_KEEP_STATE"):
        shutil.rmtree(c.state, ignore_errors=True)


@pytest.fixture(scope="session")
def kubelet(cluster: Cluster) -> Kubelet:
    k = Kubelet(kubeconfig=cluster.kubeconfig, workdir=cluster.state / "pods").start()
    yield k
    k.stop()


class Kube:
    """kubectl with the session's kubeconfig, JSON in and out."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def run(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(["kubectl", "--kubeconfig", str(self.cluster.kubeconfig), *args],
                              input=input, capture_output=True, text=True, timeout=60)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def apply(self, manifest: dict | str | Path, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
        if isinstance(manifest, Path):
            return self.run("apply", "-f", str(manifest), *extra, check=check)
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        return self.run("apply", "-f", "-", *extra, input=text, check=check)

    def get(self, kind: str, name: str | None = None, namespace: str | None = "default",
            selector: str | None = None, check: bool = True) -> Any:
        args = ["get", kind] + ([name] if name else []) + ["-o", "json"]
        if namespace:
            args += ["-n", namespace]
        if selector:
            args += ["-l", selector]
        proc = self.run(*args, check=check)
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    def delete(self, kind: str, name: str, namespace: str = "default", *extra: str) -> None:
        self.run("delete", kind, name, "-n", namespace, "--ignore-not-found", *extra)


@pytest.fixture(scope="session")
def kube(cluster: Cluster) -> Kube:
    return Kube(cluster)


def wait_for(what: str, probe: Callable[[], Any], timeout: float, interval: float = 0.5,
             on_timeout: Callable[[], str] | None = None) -> Any:
    """Poll `probe` until it returns something truthy; fail naming `what` and the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except AssertionError as err:
            last = err
        else:
            if last:
                return last
        time.sleep(interval)
    extra = on_timeout() if on_timeout else ""
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}\n{extra}", pytrace=False)


def condition(obj: dict, type_: str) -> dict | None:
    for cond in (obj or {}).get("status", {}).get("conditions", []) or []:
        if cond.get("type") == type_:
            return cond
    return None


# -- the operator ------------------------------------------------------------------------
CRD_FILE = REPO / "crds" / "modelservice.yaml"
OPERATOR_NAMESPACE = "magnitude-system"
# Timers sped up for the suite (read by the operator; defaults are production values). The token
# key is what the chart's key Secret gives the operator: stable across operator restarts, so a
# restart derives the same admin tokens and rolls nothing.
OPERATOR_ENV = {"MAGNITUDE_OPERATOR_SYNC_SECONDS": "2", "MAGNITUDE_OPERATOR_TOKEN_KEY": secrets.token_hex(32),
                "MAGNITUDE_OPERATOR_NAMESPACE": OPERATOR_NAMESPACE}


@pytest.fixture(scope="session")
def crd(kube: Kube) -> dict:
    kube.apply(CRD_FILE)
    # Polled, not `kubectl wait`: that errors out ("accessor error") when it reads the CRD before
    # the API server has written any condition, which happens on a loaded machine.
    def established() -> dict | None:
        crd = kube.get("crd", "modelservices.serving.magnitude.dev", namespace=None)
        return crd if (condition(crd, "Established") or {}).get("status") == "True" else None

    return wait_for("the CRD Established", established, 60)


def _helm() -> str | None:
    """helm as `make e2e-build` builds it (e2e/.bin), else on PATH or in ~/go/bin."""
    for candidate in (BIN / "helm", shutil.which("helm"), Path.home() / "go" / "bin" / "helm"):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    return None


def chart_objects() -> list[dict]:
    """The chart's RBAC objects: `helm template` when helm is installed; otherwise the same
    ServiceAccount, ClusterRole and ClusterRoleBinding built here from the chart's own rule
    file (charts/magnitude/files/operator-rules.yaml, which the template includes verbatim)."""
    import yaml

    chart = REPO / "charts" / "magnitude"
    helm = _helm()
    if helm is not None:
        out = subprocess.run([helm, "template", "magnitude", str(chart), "--namespace", OPERATOR_NAMESPACE],
                             capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            pytest.fail(f"helm template failed: {out.stderr}", pytrace=False)
        return [d for d in yaml.safe_load_all(out.stdout) if d]
    rules = yaml.safe_load((chart / "files" / "operator-rules.yaml").read_text())
    name = "magnitude"  # what the chart's fullname helper gives release "magnitude"
    subject = {"kind": "ServiceAccount", "name": name, "namespace": OPERATOR_NAMESPACE}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": OPERATOR_NAMESPACE}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": name},
         "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": name},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
         "subjects": [subject]},
    ]


@pytest.fixture(scope="session")
def operator_kubeconfig(cluster: Cluster, kube: Kube, crd: dict) -> Path:
    """A kubeconfig holding a token of the chart's ServiceAccount, bound only to the chart's RBAC."""
    kube.run("create", "namespace", OPERATOR_NAMESPACE, check=False)
    rbac_kinds = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
    objs = [o for o in chart_objects() if o.get("kind") in rbac_kinds]
    accounts = [o for o in objs if o["kind"] == "ServiceAccount"]
    assert len(accounts) == 1, f"expected one ServiceAccount in the chart, got {accounts}"
    for obj in objs:
        obj.setdefault("metadata", {})
        if obj["kind"] in ("ServiceAccount", "Role", "RoleBinding"):
            obj["metadata"].setdefault("namespace", OPERATOR_NAMESPACE)
        kube.apply(obj)
    sa = accounts[0]["metadata"]
    token = kube.run("create", "token", sa["name"], "-n", sa.get("namespace", OPERATOR_NAMESPACE),
                     "--duration=6h").stdout.strip()
    from cluster import write_kubeconfig

    path = cluster.state / "operator.kubeconfig"
    write_kubeconfig(path, cluster.server, cluster.pki, user=f"sa-{sa['name']}", token=token)
    # Prove it is not cluster-admin: the account may not grant itself more rights.
    denied = kube.run("--kubeconfig", str(path), "auth", "can-i", "create", "clusterrolebindings", check=False)
    assert denied.stdout.strip() == "no", "the chart's ServiceAccount must not be cluster-admin"
    return path


class OperatorProcess:
    """A real `magnitude operator` process (kopf) with its own log file."""

    def __init__(self, kubeconfig: Path, logdir: Path) -> None:
        self.kubeconfig = kubeconfig
        self.logdir = logdir
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.logdir / f"operator-{self.starts}.log"

    def start(self) -> None:
        assert self.proc is None
        self.starts += 1
        env = dict(os.environ, KUBECONFIG=str(self.kubeconfig), **OPERATOR_ENV,
                   PYTHONPATH=os.pathsep.join([str(REPO / "server"), str(REPO / "operator")]))
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "magnitude.cli.main", "operator"],
                                     cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()

    def stop(self, grace: float = 15.0) -> None:
        if self.proc is None:
            return
        import signal as _signal

        try:
            os.killpg(self.proc.pid, _signal.SIGTERM)
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, _signal.SIGKILL)
            self.proc.wait(timeout=grace)
        except ProcessLookupError:
            pass
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


@pytest.fixture(scope="session")
def operator(cluster: Cluster, operator_kubeconfig: Path, kubelet: Kubelet) -> OperatorProcess:
    op = OperatorProcess(operator_kubeconfig, cluster.state / "logs")
    op.start()
    yield op
    op.stop()
