"""A local Kubernetes control plane on loopback, built from Go modules (no Docker).

Owns the life of one throwaway cluster: certificates, kubeconfigs, free ports, and the
processes etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok (the fake
node). `Cluster.start()` returns once the API server answers /readyz and the kwok node is
Ready; `Cluster.stop()` ends every process group it started, bounded in time.
`Cluster(api_only=True)` starts just etcd + kube-apiserver (the operator's own tests), and
`audit=True` makes the API server log every request (`audit_events()`), so a test can read
which verbs a client really used. `require_control_plane()` is the one skip-or-fail gate for
suites that need these binaries, `require_tool(name)` the same for one tool (helm, promtool):
skip naming `make e2e-build`, but fail under CI=true.

Command line (used by `e2e/up.sh` / `e2e/down.sh`):
    python e2e/cluster.py up [--state DIR]     # prints `export KUBECONFIG=...`
    python e2e/cluster.py down [--state DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

E2E = Path(__file__).resolve().parent
BIN = Path(os.environ.get("MAGNITUDE_E2E_BIN", E2E / ".bin"))
DEFAULT_STATE = E2E / ".state" / "cluster"
API_BINARIES = ("etcd", "kube-apiserver")
BINARIES = (*API_BINARIES, "kube-controller-manager", "kube-scheduler", "kwok")
# Metadata of every request once answered: who, verb, resource/subresource, response code.
AUDIT_POLICY = {"apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
                "rules": [{"level": "Metadata"}]}
# Pod IPs come from loopback so the harness can bind a real engine at each one:
# the whole of 127.0.0.0/8 reaches `lo` on Linux without configuring anything.
# Each run takes its own /24 (from its pid) so suites running side by side never share
# an address:port.
def pod_cidr_for(pid: int) -> str:
    return f"127.{100 + pid % 150}.{(pid // 150) % 256}.0/24"

NODE_NAME = "kwok-node-0"
# A label a pod-shape nodeSelector can match (e2e/test_podshape.py); its taint of the same key is
# put on by that scenario alone, since every other scenario's pods must still schedule here.
NODE_POOL_LABEL = ("magnitude.dev/pool", "inference")
IP_POOL_WARMUP_POD = "kwok-ip-pool-warmup"
SERVICE_CIDR = "10.96.0.0/16"


class ClusterError(RuntimeError):
    """The control plane could not be built, started or reached."""


def missing_binaries(names: tuple[str, ...] = BINARIES) -> list[str]:
    return [name for name in names if not (BIN / name).is_file()]


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def control_plane_missing(names: tuple[str, ...] = BINARIES, tools: tuple[str, ...] = ("kubectl", "openssl"),
                          suite: str = "e2e") -> str | None:
    """Why the control plane cannot run here (None: it can)."""
    missing = missing_binaries(names)
    if missing and shutil.which("go") is None:
        return f"{suite} skipped: no Go toolchain to build the control plane ({', '.join(missing)} missing in {BIN})"
    if missing:
        return f"{suite} skipped: control-plane binaries not built ({', '.join(missing)}); run `make e2e-build`"
    for tool in tools:
        if shutil.which(tool) is None:
            return f"{suite} skipped: {tool} not found on PATH"
    return None


def require_control_plane(names: tuple[str, ...] = BINARIES, tools: tuple[str, ...] = ("kubectl", "openssl"),
                          suite: str = "e2e") -> None:
    """Skip the calling pytest test/fixture when the control plane cannot run; under CI=true a
    skip is a failure, so CI cannot go green without having run it."""
    import pytest

    reason = control_plane_missing(names, tools, suite)
    if reason is None:
        return
    if in_ci():
        pytest.fail(f"{reason} -- under CI=true a skipped {suite} suite is a failure", pytrace=False)
    pytest.skip(reason)


def tool_binary(name: str) -> str | None:
    """A tool e2e/build.sh puts in e2e/.bin (helm, promtool, prometheus, ...), else the one on PATH."""
    for candidate in (BIN / name, shutil.which(name)):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    return None


def require_tool(name: str, checks: str = "") -> str:
    """The path of `name` (see `tool_binary`); without one skip naming `make e2e-build`, or fail
    under CI=true, so CI cannot go green without having run the check. `checks` says what else
    still ran, for the skip message."""
    import pytest

    found = tool_binary(name)
    if found is not None:
        return found
    reason = f"no {name} binary ({BIN} or PATH); run `make e2e-build`" + (f". {checks}" if checks else "")
    if in_ci():
        pytest.fail(f"{reason} -- under CI=true a skipped {name} check is a failure", pytrace=False)
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ClusterError(f"openssl {' '.join(args[:2])} failed: {proc.stderr.strip()}")


def make_pki(pki: Path) -> None:
    """A CA, the API server's serving cert, an admin client cert (system:masters), SA keys."""
    pki.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
             "-days", "2", "-subj", "/CN=magnitude-e2e-ca", cwd=pki)
    (pki / "san.ext").write_text(
        "subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,"
        "DNS:kubernetes.default,DNS:kubernetes.default.svc\n"
        "extendedKeyUsage=serverAuth\n"
    )
    (pki / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name, subj, ext in (
        ("apiserver", "/CN=kube-apiserver", "san.ext"),
        ("admin", "/O=system:masters/CN=magnitude-e2e-admin", "client.ext"),
    ):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", subj, cwd=pki)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", ext, cwd=pki)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def write_kubeconfig(path: Path, server: str, pki: Path, *, user: str = "admin",
                     token: str | None = None) -> None:
    """A kubeconfig with either the admin client cert or a bearer token (for RBAC tests)."""
    creds: dict[str, str] = (
        {"token": token} if token is not None
        else {"client-certificate": str(pki / "admin.crt"), "client-key": str(pki / "admin.key")}
    )
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "e2e",
        "clusters": [{"name": "e2e", "cluster": {"server": server,
                                                  "certificate-authority": str(pki / "ca.crt")}}],
        "users": [{"name": user, "user": creds}],
        "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": user}}],
    }
    path.write_text(json.dumps(config, indent=1))  # JSON is YAML: no extra dependency


@dataclass
class Cluster:
    state: Path = DEFAULT_STATE
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    api_port: int = 0
    pod_cidr: str = field(default_factory=lambda: pod_cidr_for(os.getpid()))
    api_only: bool = False  # etcd + kube-apiserver only: no controllers, scheduler or node
    audit: bool = False

    @property
    def audit_log(self) -> Path:
        return self.state / "logs" / "audit.jsonl"

    def audit_events(self, since: int = 0) -> list[dict]:
        """Every request the API server has answered so far (needs audit=True), or only those
        logged after byte offset `since` (an earlier `audit_size()`)."""
        if not self.audit_log.exists():
            return []
        with self.audit_log.open("rb") as f:
            f.seek(since)
            text = f.read().decode()
        # The server may be mid-line: only complete lines count.
        return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]

    def audit_size(self) -> int:
        """The end of the audit log's last complete line now: a mark for `audit_events(since=...)`."""
        if not self.audit_log.exists():
            return 0
        with self.audit_log.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - 65536))
            tail = f.read()
        return size - len(tail) + tail.rfind(b"\n") + 1

    @property
    def kubeconfig(self) -> Path:
        return self.state / "kubeconfig"

    @property
    def pki(self) -> Path:
        return self.state / "pki"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    # -- processes --------------------------------------------------------------------
    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.state / "logs" / f"{name}.log", "ab")
        # Own session per component: stop() signals the whole group, nothing is orphaned.
        proc = subprocess.Popen([str(BIN / name), *args], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        self.procs[name] = proc
        self._write_pids()

    def _write_pids(self) -> None:
        (self.state / "pids.json").write_text(json.dumps({n: p.pid for n, p in self.procs.items()}))

    def _check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (self.state / "logs" / f"{name}.log").read_text(errors="replace")[-3000:]
                raise ClusterError(f"{name} exited with {proc.returncode}; log tail:\n{tail}")

    def _wait(self, what: str, ready, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                if ready():
                    return
            except Exception:  # not up yet: connection refused, 500 while starting, ...
                pass
            time.sleep(0.25)
        raise ClusterError(f"{what} not ready after {timeout:.0f}s (logs in {self.state / 'logs'})")

    def _get(self, path: str) -> tuple[int, bytes]:
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        ctx.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        with urllib.request.urlopen(self.server + path, context=ctx, timeout=5) as resp:
            return resp.status, resp.read()

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        proc = subprocess.run(["kubectl", "--kubeconfig", str(self.kubeconfig), *args], input=input,
                              capture_output=True, text=True, timeout=60)
        if check and proc.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)}: {proc.stderr.strip()}")
        return proc.stdout

    # -- life cycle -------------------------------------------------------------------
    def start(self, timeout: float = 120.0) -> "Cluster":
        missing = missing_binaries(API_BINARIES if self.api_only else BINARIES)
        if missing:
            raise ClusterError(f"missing binaries in {BIN}: {missing}; run `make e2e-build`")
        stop_recorded(self.state)
        shutil.rmtree(self.state, ignore_errors=True)
        (self.state / "logs").mkdir(parents=True)
        make_pki(self.pki)
        pki = self.pki
        etcd_port, etcd_peer = free_port(), free_port()
        self.api_port = free_port()
        write_kubeconfig(self.kubeconfig, self.server, pki)
        audit_flags: list[str] = []
        if self.audit:
            (self.state / "audit-policy.json").write_text(json.dumps(AUDIT_POLICY))
            audit_flags = [f"--audit-policy-file={self.state / 'audit-policy.json'}",
                           f"--audit-log-path={self.audit_log}", "--audit-log-format=json",
                           "--audit-log-mode=blocking"]
        try:
            self._spawn("etcd", [
                "--name=e2e", f"--data-dir={self.state / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
                f"--initial-cluster=e2e=http://127.0.0.1:{etcd_peer}",
                "--unsafe-no-fsync", "--log-level=warn",
            ])
            self._spawn("kube-apiserver", [
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
                f"--secure-port={self.api_port}",
                f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=RBAC", "--allow-privileged=true",
                "--endpoint-reconciler-type=none", "--v=1", *audit_flags,
            ])
            self._wait("kube-apiserver", lambda: self._get("/readyz")[0] == 200, timeout)
            if self.api_only:
                return self
            common = [f"--kubeconfig={self.kubeconfig}", "--leader-elect=false", "--v=1"]
            self._spawn("kube-controller-manager", [
                *common,
                f"--authentication-kubeconfig={self.kubeconfig}",
                f"--authorization-kubeconfig={self.kubeconfig}",
                "--bind-address=127.0.0.1", f"--secure-port={free_port()}",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                # HPA reads the scale subresource often enough for a test to see it act.
                "--horizontal-pod-autoscaler-sync-period=2s",
                "--controllers=*,-nodeipam",
            ])
            self._spawn("kube-scheduler", [
                *common,
                f"--authentication-kubeconfig={self.kubeconfig}",
                f"--authorization-kubeconfig={self.kubeconfig}",
                "--bind-address=127.0.0.1", f"--secure-port={free_port()}",
            ])
            self._spawn("kwok", [
                f"--kubeconfig={self.kubeconfig}", f"--config={E2E / 'kwok-stages.yaml'}",
                "--manage-all-nodes=true", f"--cidr={self.pod_cidr}", "--node-ip=127.0.0.1",
                "--node-lease-duration-seconds=40", f"--server-address=127.0.0.1:{free_port()}",
            ])
            self.kubectl("apply", "-f", "-", input=json.dumps(node_manifest(self.pod_cidr)))
            self._wait("kwok node", self._node_ready, timeout)
            self._wait("default service account", lambda: bool(
                self.kubectl("get", "serviceaccount", "default", "-o", "name", check=False).strip()), timeout)
            self._warm_ip_pool(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _warm_ip_pool(self, timeout: float) -> None:
        """Have kwok create the node's pod IP pool with one pod before any test creates several.

        kwok v0.8.0 creates a CIDR's pool with an unsynchronised load-or-store
        (`PodController.ipPool`): two pods made Running at once on a fresh kwok can each get a new
        pool and both receive the pool's first address (seen in CI: two replicas on 127.x.y.1).
        Once the pool exists every allocation goes through its mutex."""
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": IP_POOL_WARMUP_POD, "namespace": "default"},
               "spec": {"nodeName": NODE_NAME, "automountServiceAccountToken": False,
                        "containers": [{"name": "warmup", "image": "none"}]}}
        self.kubectl("apply", "-f", "-", input=json.dumps(pod))
        self._wait("kwok pod IP pool", lambda: bool(self.kubectl(
            "get", "pod", IP_POOL_WARMUP_POD, "-n", "default", "-o", "jsonpath={.status.podIP}").strip()), timeout)
        # kubectl() itself gives up after 60 s.
        self.kubectl("delete", "pod", IP_POOL_WARMUP_POD, "-n", "default", "--wait=true", "--timeout=50s")

    def _node_ready(self) -> bool:
        node = json.loads(self.kubectl("get", "node", NODE_NAME, "-o", "json"))
        return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions", []))

    def stop(self, grace: float = 10.0) -> None:
        # Reverse start order: the API server's clients go before it, etcd last.
        for name in reversed(list(self.procs)):
            _end_group(self.procs[name].pid, grace, self.procs[name])
        self.procs.clear()
        (self.state / "pids.json").unlink(missing_ok=True)


def node_manifest(pod_cidr: str) -> dict:
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": NODE_NAME, "annotations": {"kwok.x-k8s.io/node": "fake"},
                     "labels": {"kubernetes.io/hostname": NODE_NAME, "kubernetes.io/os": "linux",
                                "kubernetes.io/arch": "amd64", "type": "kwok",
                                NODE_POOL_LABEL[0]: NODE_POOL_LABEL[1]}},
        "spec": {"podCIDR": pod_cidr, "podCIDRs": [pod_cidr]},
        "status": {"capacity": {"cpu": "64", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": "8"},
                   "allocatable": {"cpu": "64", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": "8"}},
    }


def _end_group(pid: int, grace: float, proc: subprocess.Popen | None = None) -> None:
    """SIGTERM the process group, SIGKILL what is left after `grace` seconds.

    With `proc` (our own child) wait on it, since an unreaped leader still counts as alive."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    if proc is not None:
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            pass
    else:
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if proc is not None:
        proc.wait(timeout=grace)


def processes_mentioning(path: Path) -> list[tuple[int, str]]:
    """Live processes whose command line names `path` (leak check after teardown)."""
    needle = str(path).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            if needle in cmdline and (entry / "stat").read_text().split(") ")[-1][:1] != "Z":
                found.append((int(entry.name), cmdline.replace(b"\0", b" ").decode(errors="replace")[:160]))
        except OSError:
            continue
    return found


def stop_recorded(state: Path, grace: float = 10.0) -> None:
    """Stop processes a previous run recorded, only if they still run one of our binaries."""
    pids_file = state / "pids.json"
    if not pids_file.exists():
        return
    for name, pid in reversed(list(json.loads(pids_file.read_text()).items())):
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:
            continue
        if Path(exe).name == name and Path(exe).parent.resolve() == BIN.resolve():
            _end_group(pid, grace)
    pids_file.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--state", type=Path, default=DEFAULT_STATE)
    args = parser.parse_args(argv)
    if args.action == "down":
        stop_recorded(args.state)
        return 0
    cluster = Cluster(state=args.state)
    try:
        cluster.start()
    except ClusterError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    # Detach: the processes outlive this command; `down` ends them via pids.json.
    print(f"export KUBECONFIG={cluster.kubeconfig}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
