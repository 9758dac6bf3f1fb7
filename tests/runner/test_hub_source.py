"""`hf://` sources through the real `huggingface_hub` client against a hub stand-in on loopback
(hub_standin.py: the real hub cannot be reached from here), and the model cache they land in.

In-process: revision pinning, the token, only the served files downloaded, pickle-only repos
refused before any download, concurrent starts downloading once, LRU cleanup. As a real
`magnitude serve` process: the `downloading` phase with bytes, the served name and pinned
revision in /v1/models and /readyz, greedy output equal to `generate` on that revision's
weights, and a restart with the hub down serving from the cache (first and second ready times
printed).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

torch = pytest.importorskip("torch")

from magnitude.runner import model_cache, model_source  # noqa: E402
from magnitude.runner.model_source import HubSourceError  # noqa: E402

from .hub_standin import HubStandIn  # noqa: E402
from .tiny_models import build_tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "hf_standin_token"
REPO = "tiny-org/tiny-llama"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("tiny")
    return {"v1": build_tiny_model("llama", base / "v1", seed=1), "v2": build_tiny_model("llama", base / "v2", seed=2)}


@pytest.fixture
def hub(models, monkeypatch, tmp_path):
    h = HubStandIn(token=TOKEN)
    repo = h.repo(REPO)
    # v1 is tagged; main moves on to v2. Junk the engine must not download rides along.
    h.v1 = repo.add_commit(models["v1"], refs=("v1",), extra={"README.md": b"# tiny", "pytorch_model.bin": b"\x80\x04"})
    h.v2 = repo.add_commit(models["v2"], refs=("main",), extra={"onnx_model.onnx": b"x" * 1000})
    h.start()
    monkeypatch.setenv("HF_ENDPOINT", h.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("MAGNITUDE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    yield h
    h.stop()


def _noop(*args) -> None:
    return None


def test_parse_syntax():
    assert model_source.parse("hf://org/name") == model_source.HubSpec("org/name", "main", None)
    assert model_source.parse("hf://org/name@v1.0") == model_source.HubSpec("org/name", "v1.0", None)
    assert model_source.parse("hf://org/name/sub/m.Q4_0.gguf@abc", None).gguf == "sub/m.Q4_0.gguf"
    assert model_source.parse("hf://org/name", revision="v2").revision == "v2"
    for bad in ("hf://name", "hf://org/name/weights.bin", "hf://org/../x"):
        with pytest.raises(HubSourceError):
            model_source.parse(bad)
    with pytest.raises(HubSourceError, match="--revision"):
        model_source.parse("hf://org/name@a", revision="b")


def test_revision_pinned_only_served_files_downloaded(hub):
    got = model_source.fetch(model_source.parse(f"hf://{REPO}@v1"), _noop)
    assert got.sha == hub.v1 and not got.cache_hit
    files = sorted(p.name for p in got.path.iterdir())
    assert "pytorch_model.bin" not in files and "README.md" not in files
    assert {"config.json", "model.safetensors", "tokenizer.json", model_cache.MARKER} <= set(files)
    assert json.loads((got.path / model_cache.MARKER).read_text())["revision"] == hub.v1
    assert (got.path / "model.safetensors").read_bytes() == hub.repos[REPO].commits[hub.v1].files["model.safetensors"]
    main = model_source.fetch(model_source.parse(f"hf://{REPO}"), _noop)
    assert main.sha == hub.v2 and main.path != got.path
    # The same revision again: from the cache, nothing downloaded a second time.
    again = model_source.fetch(model_source.parse(f"hf://{REPO}@v1"), _noop)
    assert again.cache_hit and again.path == got.path and hub.downloads("model.safetensors") == 2


def test_token_required_by_the_hub(hub, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(HubSourceError, match="HF_TOKEN"):
        model_source.fetch(model_source.parse(f"hf://{REPO}"), _noop)
    monkeypatch.setenv("HF_TOKEN", "wrong")
    with pytest.raises(HubSourceError, match="401"):
        model_source.fetch(model_source.parse(f"hf://{REPO}"), _noop)


def test_unknown_repo_and_revision(hub):
    with pytest.raises(HubSourceError, match="RepositoryNotFound"):
        model_source.fetch(model_source.parse("hf://tiny-org/nope"), _noop)
    with pytest.raises(HubSourceError, match="RevisionNotFound"):
        model_source.fetch(model_source.parse(f"hf://{REPO}@no-such-tag"), _noop)


def test_pickle_only_repo_refused_before_download(hub, models, tmp_path):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    for f in models["v1"].iterdir():
        if f.suffix != ".safetensors":
            (pickled / f.name).write_bytes(f.read_bytes())
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04")
    hub.repo("tiny-org/pickled").add_commit(pickled)
    with pytest.raises(HubSourceError, match="pickle"):
        model_source.fetch(model_source.parse("hf://tiny-org/pickled"), _noop)
    assert not [p for m, p in hub.requests if "/resolve/" in p]


def test_named_gguf_missing_is_refused_naming_the_files(hub):
    with pytest.raises(HubSourceError, match="no file 'm.gguf'"):
        model_source.fetch(model_source.parse(f"hf://{REPO}/m.gguf"), _noop)


def test_downloading_progress_reports_bytes(hub):
    hub.bytes_per_s = 400_000  # ~0.5 s for the tiny model, so the watcher reports in between
    seen: list[tuple[str, float, dict]] = []
    model_source.fetch(model_source.parse(f"hf://{REPO}@v1"), lambda ph, fr, detail=None: seen.append((ph, fr, detail)))
    total = sum(len(d) for n, d in hub.repos[REPO].commits[hub.v1].files.items() if n not in ("README.md", "pytorch_model.bin"))
    assert all(ph == "downloading" and d["bytes_total"] == total for ph, _fr, d in seen)
    assert seen[0][2]["bytes_done"] == 0 and seen[-1][2]["bytes_done"] == total
    assert any(0 < d["bytes_done"] < total for _ph, _fr, d in seen), seen  # a live reading mid-download


def test_concurrent_starts_download_once(hub):
    hub.bytes_per_s = 1_000_000
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(
        model_source.fetch(model_source.parse(f"hf://{REPO}@v1"), _noop))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({r.path for r in results}) == 1 and len(results) == 3
    assert hub.downloads("model.safetensors") == 1
    assert sorted(r.cache_hit for r in results) == [False, True, True]


def test_offline_once_cached(hub, monkeypatch):
    first = model_source.fetch(model_source.parse(f"hf://{REPO}@v1"), _noop)
    hub.stop()  # the hub is down: the branch/tag resolved last time is served from the cache
    again = model_source.fetch(model_source.parse(f"hf://{REPO}@v1"), _noop)
    assert again.path == first.path and again.sha == hub.v1 and again.cache_hit
    with pytest.raises(HubSourceError, match="cannot be reached"):
        model_source.fetch(model_source.parse(f"hf://{REPO}@never-fetched"), _noop)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert model_source.fetch(model_source.parse(f"hf://{REPO}@{hub.v1}"), _noop).path == first.path
    hub.start = lambda: hub  # already stopped; the fixture's stop() must not fail
    hub.stop = lambda: None


def test_cache_cleanup_is_lru_and_spares_locked_entries(tmp_path):
    root = tmp_path / "models"
    entries = []
    for i in range(5):
        e = root / f"e{i}"
        model_cache.write_entry(e, lambda d: (d / "config.json").write_text("{}"), {"i": i})
        os.utime(e / model_cache.MARKER, (1000 + i, 1000 + i))
        entries.append(e)
    model_cache.touch(entries[0])  # used now: the most recent
    with model_cache.locked(entries[1]):  # held by another writer/reader
        removed = model_cache.cleanup(entries[4], max_entries=2)
    assert sorted(p.name for p in removed) == ["e2", "e3"]
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["e0", "e1", "e4"]
    assert model_cache.cleanup(entries[4], max_entries=10, max_bytes=0) == [entries[0], entries[1]]


# -- the real process ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(port: int, env: dict[str, str], *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "magnitude.cli.main", "serve", "--port", str(port), "--device", "cpu",
           "--set", "kvCache.numBlocks=64", *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 120) -> list[dict]:
    """Poll /readyz until ready; the not-ready bodies seen on the way."""
    seen: list[dict] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            r = httpx.get(url + "/readyz", timeout=1)
            if r.status_code == 200:
                return seen
            seen.append(r.json())
            assert r.json().get("phase") != "failed", r.json()
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    pytest.fail(f"{url} not ready in {timeout}s")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.mark.model
def test_serve_hf_source_then_restart_offline(hub, models, tmp_path):
    from transformers import AutoModelForCausalLM

    hub.bytes_per_s = 300_000
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'server'}:{ROOT / 'operator'}", "HF_HUB_DISABLE_XET": "1"}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ("--model", f"hf://{REPO}", "--revision", "v1", "--served-model-name", "my-tiny")
    t0 = time.monotonic()
    proc = _serve(port, env, *args)
    try:
        seen = _wait_ready(url, proc)
        first_ready = time.monotonic() - t0
        downloading = [b for b in seen if b.get("phase") == "downloading"]
        assert downloading and all(b["bytes_total"] > 0 for b in downloading), seen
        assert max(b["bytes_done"] for b in downloading) > 0
        ready = httpx.get(url + "/readyz").json()
        assert ready["model"] == "my-tiny" and ready["revision"] == hub.v1 and ready["source"] == f"hf://{REPO}@v1"
        listed = httpx.get(url + "/v1/models").json()["data"]
        assert [m["id"] for m in listed] == ["my-tiny"] and listed[0]["revision"] == hub.v1
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        got = client.completions.create(model="my-tiny", prompt="t5 t9 t44 t100", max_tokens=8, temperature=0)
        with pytest.raises(openai.NotFoundError):  # the source's own name is not served (vLLM's rule)
            client.completions.create(model=REPO, prompt="t5", max_tokens=1)
    finally:
        _stop(proc)
    ref = AutoModelForCausalLM.from_pretrained(models["v1"], dtype=torch.float32).eval()
    ids = ref.generate(torch.tensor([[5, 9, 44, 100]]), max_new_tokens=8, do_sample=False, eos_token_id=2,
                       pad_token_id=0)[0, 4:].tolist()
    want = " ".join(f"t{i}" for i in ids if i != 2)
    assert got.choices[0].text.split() == want.split()  # v1's weights, not main's

    hub.stop()  # the hub is down for the restart
    hub.stop = lambda: None
    t1 = time.monotonic()
    proc = _serve(port, env, *args)
    try:
        seen = _wait_ready(url, proc)
        second_ready = time.monotonic() - t1
        assert not [b for b in seen if b.get("phase") == "downloading"]
        assert httpx.get(url + "/v1/models").json()["data"][0]["revision"] == hub.v1
    finally:
        _stop(proc)
    print(f"\nhf:// tiny model: first start ready in {first_ready:.1f}s (download throttled to 300 kB/s), "
          f"restart with the hub down ready in {second_ready:.1f}s")


def test_revision_for_a_source_without_revisions_is_refused():
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'server'}:{ROOT / 'operator'}"}
    r = subprocess.run([sys.executable, "-m", "magnitude.cli.main", "serve", "--revision", "v1"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--revision 'v1'" in r.stderr and "hf://" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "magnitude.cli.main", "serve", "--model", "hf://a/b@x", "--revision", "y"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "names revision 'x'" in r.stderr, r.stderr


def test_custom_code_repo_refused_from_its_config_before_the_weights(hub, models, tmp_path):
    from magnitude.runner.loading import ModelSourceError, load_model

    custom = tmp_path / "custom"
    custom.mkdir()
    for f in models["v1"].iterdir():
        (custom / f.name).write_bytes(f.read_bytes())
    config = json.loads((custom / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM"}
    (custom / "config.json").write_text(json.dumps(config))
    hub.repo("tiny-org/custom").add_commit(custom, extra={"modeling_tiny.py": b"import os\n"})
    with pytest.raises(ModelSourceError, match="trust_remote_code") as e:
        load_model("hf://tiny-org/custom", device="cpu")
    assert "hf://tiny-org/custom@main" in str(e.value)
    assert hub.downloads("config.json") == 1 and hub.downloads("model.safetensors") == 0
    assert not [p for p in model_cache.models_dir().iterdir() if p.is_dir() and p.name.startswith("hf-")]
