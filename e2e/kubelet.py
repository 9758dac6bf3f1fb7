"""A minimal kubelet for kwok pods: runs a real `magnitude serve` at each Running pod's IP.

kwok makes pods Running and gives them a loopback pod IP (see kwok-stages.yaml) but runs
nothing. This loop does the part of a kubelet the operator can observe: for every Running
pod on the kwok node it materialises the pod's ConfigMap/Secret volumes (Secret volumes kept current), its
PersistentVolumeClaims (the hostPath folder of the static PV each is bound to, shared by every pod
that mounts it) and env (value, secretKeyRef, configMapKeyRef, fieldRef, envFrom), rewrites
the container's own command line (mount paths -> local folders, listen host -> pod IP,
plus `--runner simulated` unless told to run the real model) and starts it. It sets the
pod's Ready condition from the container's readinessProbe, restarts a container that exits
(restartCount), and stops the process when the pod goes away. Nothing here is specific to
a ModelService: it reads only the pod spec the operator wrote.

One test hook that no kubelet has: `metrics_faults` puts a tiny TCP proxy (`FaultProxy`) in front
of the engines of the named ModelServices, so a chaos test can make their `/metrics` serve
garbage or nothing while everything else (readiness, the API) passes through untouched.
"""

from __future__ import annotations

import base64
import os
import selectors
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from kubernetes import client, config

REPO = Path(__file__).resolve().parent.parent
NODE_NAME = "kwok-node-0"


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Engine:
    """One container process standing in for a pod."""

    key: str  # namespace/name
    uid: str
    ip: str
    proc: subprocess.Popen
    argv: list[str]
    ready_url: str | None
    ready: bool = False
    restarts: int = 0
    proxy: "FaultProxy | None" = None
    secrets: list = field(default_factory=list)  # (V1SecretVolumeSource, local folder) to keep current


@dataclass
class Kubelet:
    kubeconfig: Path
    workdir: Path
    # runner per ModelService-ish owner: pod label value -> "simulated" | "real".
    runner_for: dict[str, str] = field(default_factory=dict)
    default_runner: str = "simulated"
    owner_label: str = "serving.magnitude.dev/modelservice"
    extra_args: list[str] = field(default_factory=list)
    # Test hook: ModelService name -> the fault its pods' /metrics serve (see MetricsFault).
    metrics_faults: dict[str, "MetricsFault"] = field(default_factory=dict)
    engines: dict[str, Engine] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        api = config.new_client_from_config(config_file=str(self.kubeconfig))
        self.core = client.CoreV1Api(api)

    # -- loop -------------------------------------------------------------------------
    def start(self) -> "Kubelet":
        self._thread = threading.Thread(target=self._run, name="e2e-kubelet", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception as err:  # keep going: a test reads self.errors on failure
                self.errors.append(f"{now()} sync: {err!r}")
                del self.errors[:-50]
            self._stop.wait(0.5)

    def sync(self) -> None:
        pods = self.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={NODE_NAME}").items
        running = {
            f"{p.metadata.namespace}/{p.metadata.name}": p for p in pods
            if p.status.phase == "Running" and p.status.pod_ip and not p.metadata.deletion_timestamp
        }
        # Stop what went away first: kwok may hand a freed pod IP to the next pod.
        for key, engine in list(self.engines.items()):
            if key not in running or running[key].metadata.uid != engine.uid:
                self._kill(key)
        for key, pod in running.items():
            engine = self.engines.get(key) or self._launch(pod)
            self._check(pod, engine)

    # -- containers -------------------------------------------------------------------
    def _launch(self, pod) -> Engine:
        key = f"{pod.metadata.namespace}/{pod.metadata.name}"
        root = self.workdir / pod.metadata.namespace / pod.metadata.name
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        container = pod.spec.containers[0]
        secrets: list = []
        mounts = self._volumes(pod, container, root, secrets)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO / "server"), str(REPO / "operator")])
        env.update(self._env(pod, container))
        argv = self.command_line(pod, container, mounts)
        proxy = None
        fault = self.metrics_faults.get((pod.metadata.labels or {}).get(self.owner_label, ""))
        if fault is not None:
            # The engine moves to a free port of the pod IP; the proxy takes the container's port.
            argv, port, engine_port = _move_port(argv, pod.status.pod_ip)
            proxy = FaultProxy(fault, (pod.status.pod_ip, port), (pod.status.pod_ip, engine_port))
        env = {k: _rewrite(v, mounts) for k, v in env.items()}
        log = open(self.workdir / f"{pod.metadata.namespace}_{pod.metadata.name}.log", "ab")
        log.write(f"# {now()} {shlex.join(argv)}\n".encode())
        log.flush()
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        probe = container.readiness_probe
        ready_url = None
        if probe is not None and probe.http_get is not None:
            port = _port(probe.http_get.port, container)
            ready_url = f"http://{pod.status.pod_ip}:{port}{probe.http_get.path or '/'}"
        engine = Engine(key=key, uid=pod.metadata.uid, ip=pod.status.pod_ip, proc=proc, argv=argv,
                        ready_url=ready_url, proxy=proxy, secrets=secrets)
        old = self.engines.get(key)
        if old is not None:
            engine.restarts = old.restarts
        self.engines[key] = engine
        return engine

    def command_line(self, pod, container, mounts: dict[str, Path]) -> list[str]:
        raw = list(container.command or ["magnitude"]) + list(container.args or [])
        argv = [_rewrite(a, mounts) for a in raw]
        if Path(argv[0]).name == "magnitude":
            argv[0:1] = [sys.executable, "-m", "magnitude.cli.main"]
        # "All interfaces" inside a pod means the pod's own address.
        argv = [a.replace("0.0.0.0", pod.status.pod_ip) for a in argv]
        if "serve" in argv and not any(a == "--host" or a.startswith("--host=") for a in argv):
            argv += ["--host", pod.status.pod_ip]
        owner = (pod.metadata.labels or {}).get(self.owner_label, "")
        runner = self.runner_for.get(owner, self.default_runner)
        if "serve" in argv and "--runner" not in argv:
            argv += ["--runner", runner]
        return argv + self.extra_args

    def _volumes(self, pod, container, root: Path, secrets: list) -> dict[str, Path]:
        """Local folders for the container's mounts; Secret volumes also go into `secrets` (kept
        up to date while the pod runs, as a kubelet does for every mount but a subPath)."""
        by_name = {v.name: v for v in pod.spec.volumes or []}
        mounts: dict[str, Path] = {}
        for mount in container.volume_mounts or []:
            vol = by_name.get(mount.name)
            if vol is None:
                continue
            local = root / "volumes" / mount.name
            local.mkdir(parents=True, exist_ok=True)
            if vol.config_map is not None:
                cm = self.core.read_namespaced_config_map(vol.config_map.name, pod.metadata.namespace)
                for k, v in (cm.data or {}).items():
                    (local / k).write_text(v)
            elif vol.secret is not None:
                self._write_secret(vol.secret, pod.metadata.namespace, local)
                secrets.append((vol.secret, local))
            elif vol.projected is not None or vol.empty_dir is not None:
                pass  # service-account token / scratch space: an empty folder is enough here
            elif vol.persistent_volume_claim is not None:
                local = self._claim_folder(vol.persistent_volume_claim.claim_name, pod.metadata.namespace)
            target = local / mount.sub_path if mount.sub_path else local
            mounts[mount.mount_path] = target
        return mounts

    def _claim_folder(self, claim: str, namespace: str) -> Path:
        """The folder behind a PersistentVolumeClaim: the hostPath of the static PV it is bound to,
        the same folder for every pod that mounts the claim (as a shared volume is). Until the claim
        is bound the pod does not start, as on a real node. (Read-only mounts are not enforced.)"""
        pvc = self.core.read_namespaced_persistent_volume_claim(claim, namespace)
        if not pvc.spec.volume_name or (pvc.status.phase or "") != "Bound":
            raise RuntimeError(f"PersistentVolumeClaim {namespace}/{claim} is not bound yet")
        pv = self.core.read_persistent_volume(pvc.spec.volume_name)
        if pv.spec.host_path is None:
            raise RuntimeError(f"PersistentVolume {pv.metadata.name} has no hostPath (this stand-in backs only those)")
        folder = Path(pv.spec.host_path.path)
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def _write_secret(self, source, namespace: str, local: Path) -> None:
        """The Secret's keys (or only its `items`, under their paths) as files; a file is replaced
        atomically and only when its content changed, so a reader never sees half a file."""
        data = self.core.read_namespaced_secret(source.secret_name, namespace).data or {}
        files = {i.path: data[i.key] for i in source.items} if source.items else data
        for path, value in files.items():
            target, content = local / path, base64.b64decode(value)
            if target.exists() and target.read_bytes() == content:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.tmp")
            tmp.write_bytes(content)
            tmp.replace(target)

    def _env(self, pod, container) -> dict[str, str]:
        out: dict[str, str] = {}
        ns = pod.metadata.namespace
        # envFrom first: an `env` entry of the same name wins, as on a real kubelet.
        for source in container.env_from or []:
            prefix = source.prefix or ""
            if source.config_map_ref is not None:
                data = self.core.read_namespaced_config_map(source.config_map_ref.name, ns).data or {}
                out.update({prefix + k: v for k, v in data.items()})
            elif source.secret_ref is not None:
                data = self.core.read_namespaced_secret(source.secret_ref.name, ns).data or {}
                out.update({prefix + k: base64.b64decode(v).decode() for k, v in data.items()})
        for var in container.env or []:
            if var.value is not None:
                out[var.name] = var.value
            elif var.value_from is not None:
                src = var.value_from
                if src.secret_key_ref is not None:
                    sec = self.core.read_namespaced_secret(src.secret_key_ref.name, ns)
                    out[var.name] = base64.b64decode((sec.data or {})[src.secret_key_ref.key]).decode()
                elif src.config_map_key_ref is not None:
                    cm = self.core.read_namespaced_config_map(src.config_map_key_ref.name, ns)
                    out[var.name] = (cm.data or {})[src.config_map_key_ref.key]
                elif src.field_ref is not None:
                    out[var.name] = _field(pod, src.field_ref.field_path)
        return out

    def _check(self, pod, engine: Engine) -> None:
        if engine.proc.poll() is not None:
            # CrashLoop without the back-off: restart and count it, like a kubelet would.
            restarts = engine.restarts + 1
            self._kill(engine.key)
            engine = self._launch(pod)
            engine.restarts = restarts
        for source, local in engine.secrets:  # a Secret edited while the pod runs reaches its files
            try:
                self._write_secret(source, pod.metadata.namespace, local)
            except Exception as err:  # a missing Secret must not stop the other pods' sync
                self.errors.append(f"{now()} {engine.key}: secret {source.secret_name}: {err!r}")
                del self.errors[:-50]
        ready = engine.ready_url is None or _http_ok(engine.ready_url)
        current = {c.type: c.status for c in pod.status.conditions or []}
        statuses = pod.status.container_statuses or []
        restarts_now = statuses[0].restart_count if statuses else 0
        if current.get("Ready") == str(ready) and restarts_now == engine.restarts:
            engine.ready = ready
            return
        status = "True" if ready else "False"
        reason = None if ready else "EngineNotReady"
        conds = [c for c in (pod.status.conditions or []) if c.type not in ("Ready", "ContainersReady")]
        body_conds = [{"type": c.type, "status": c.status, "lastTransitionTime": c.last_transition_time}
                      for c in conds]
        for t in ("Ready", "ContainersReady"):
            body_conds.append({"type": t, "status": status, "reason": reason, "lastTransitionTime": now()})
        cstat = [{"name": c.name, "image": c.image, "ready": ready, "started": True,
                  "restartCount": engine.restarts, "state": {"running": {"startedAt": now()}}}
                 for c in pod.spec.containers]
        self.core.patch_namespaced_pod_status(
            pod.metadata.name, pod.metadata.namespace,
            {"status": {"conditions": body_conds, "containerStatuses": cstat}})
        engine.ready = ready

    def _kill(self, key: str) -> None:
        engine = self.engines.pop(key, None)
        if engine is None:
            return
        if engine.proxy is not None:
            engine.proxy.close()
        _end_group(engine.proc, 10.0)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for key in list(self.engines):
            self._kill(key)

    def log_tail(self, key: str, chars: int = 3000) -> str:
        ns, name = key.split("/", 1)
        path = self.workdir / f"{ns}_{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def _move_port(argv: list[str], ip: str) -> tuple[list[str], int, int]:
    """(argv with `--port` moved to a free port of `ip`, the old port, the new one)."""
    i = argv.index("--port")
    with socket.create_server((ip, 0)) as s:
        free = s.getsockname()[1]
    return argv[:i + 1] + [str(free)] + argv[i + 2:], int(argv[i + 1]), free


class MetricsFault:
    """What `GET /metrics` of one ModelService's pods serves through their FaultProxy: `pass`
    (the engine's own answer), `garbage` (samples no consumer may use: a NaN ratio, a negative
    gauge, a bucket without `le`) or `silent` (the request is read and never answered).
    Changing the mode cuts the connections open through the proxies, so a client's pooled
    keep-alive connection cannot go on seeing the previous mode."""

    GARBAGE = (b"# served by the e2e stand-in's fault proxy\n"
               b"magnitude_kv_cache_usage_ratio NaN\n"
               b"magnitude_requests_waiting -3\n"
               b'magnitude_queue_time_seconds_bucket{priority_class="standard"} 7\n')

    def __init__(self) -> None:
        self.mode = "pass"
        self.metrics_requests = 0  # /metrics requests that met a fault (not `pass`)
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()

    def set(self, mode: str) -> None:
        assert mode in ("pass", "garbage", "silent"), mode
        with self._lock:
            self.mode = mode
            doomed = list(self._open)
        for sock in doomed:
            _shut(sock)

    def track(self, sock: socket.socket, on: bool) -> None:
        with self._lock:
            (self._open.add if on else self._open.discard)(sock)


class FaultProxy:
    """A tiny TCP proxy at a pod's address: each connection's first request decides. `/metrics`
    under a fault is answered (or not) here; anything else is spliced to the engine byte for byte,
    streams included. Under a fault a spliced request goes with `connection: close`, so a client
    cannot send its next `/metrics` down a keep-alive connection opened by `/readyz` and past the fault."""

    def __init__(self, fault: MetricsFault, listen: tuple[str, int], upstream: tuple[str, int]) -> None:
        self.fault, self.upstream = fault, upstream
        self.server = socket.create_server(listen)
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name=f"fault-proxy {listen}", daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        _shut(self.server)
        self.server.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        self.fault.track(conn, True)
        try:
            head = _read_head(conn)
            path = head.split(b" ", 2)[1] if head.count(b" ") >= 2 else b""
            mode = self.fault.mode
            if path.startswith(b"/metrics") and mode != "pass":
                self.fault.metrics_requests += 1
                if mode == "garbage":
                    body = MetricsFault.GARBAGE
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body)
                else:  # silent: hold the request until the client gives up or the mode changes
                    while not self._closed.is_set() and conn.recv(4096):
                        pass
                return
            if mode != "pass":
                head = head.replace(b"\r\n", b"\r\nconnection: close\r\n", 1)
            with socket.create_connection(self.upstream, timeout=5) as up:
                up.settimeout(None)
                self.fault.track(up, True)
                try:
                    up.sendall(head)
                    self._splice(conn, up)
                finally:
                    self.fault.track(up, False)
        except OSError:
            pass  # either side went away: a proxy has nothing to add
        finally:
            self.fault.track(conn, False)
            conn.close()

    def _splice(self, a: socket.socket, b: socket.socket) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(a, selectors.EVENT_READ, b)
            sel.register(b, selectors.EVENT_READ, a)
            while not self._closed.is_set():
                for key, _ in sel.select(timeout=1.0):
                    data = key.fileobj.recv(65536)
                    if not data:
                        return
                    key.data.sendall(data)


def _read_head(conn: socket.socket, limit: int = 65536) -> bytes:
    """Bytes up to the end of the first request's headers (whatever else arrived comes too)."""
    conn.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data and len(data) < limit:
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    conn.settimeout(None)
    return data


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _rewrite(value: str, mounts: dict[str, Path]) -> str:
    # Longest mount path first so /etc/a/b wins over /etc/a.
    for mount_path in sorted(mounts, key=len, reverse=True):
        if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
            return str(mounts[mount_path]) + value[len(mount_path.rstrip("/")):]
        if "=" in value:
            flag, _, rest = value.partition("=")
            if rest == mount_path or rest.startswith(mount_path.rstrip("/") + "/"):
                return f"{flag}={_rewrite(rest, mounts)}"
    return value


def _port(port, container) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.ports or []:
        if p.name == port:
            return p.container_port
    raise ValueError(f"unknown named port {port!r}")


def _field(pod, path: str) -> str:
    table = {"metadata.name": pod.metadata.name, "metadata.namespace": pod.metadata.namespace,
             "metadata.uid": pod.metadata.uid, "status.podIP": pod.status.pod_ip,
             "spec.nodeName": pod.spec.node_name, "status.hostIP": pod.status.host_ip or "127.0.0.1"}
    if path.startswith("metadata.labels['"):
        return (pod.metadata.labels or {}).get(path[len("metadata.labels['"):-2], "")
    if path.startswith("metadata.annotations['"):
        return (pod.metadata.annotations or {}).get(path[len("metadata.annotations['"):-2], "")
    return str(table.get(path, ""))


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return 200 <= resp.status < 400
    except Exception:
        return False


def _end_group(proc: subprocess.Popen, grace: float) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=grace)
