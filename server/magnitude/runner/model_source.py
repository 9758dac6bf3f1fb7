"""`hf://` model sources: parse, pin the revision, download only what is served, into the model cache.

Syntax: `hf://org/name[@revision]` downloads a Hugging Face model (config, generation config,
tokenizer files, `*.safetensors` and their index); `hf://org/name/path/file.gguf[@revision]`
downloads that one GGUF file (converted afterwards like any GGUF). The revision is a branch, tag or
commit; it is resolved to its commit SHA through the hub's model-info API, and the files are
fetched at that SHA (`huggingface_hub.snapshot_download`, `allow_patterns` = the chosen files) into
`$MAGNITUDE_CACHE/models/<key>` with `key = hash(repo, file, SHA)`. The hub address is
`HF_ENDPOINT` and the token `HF_TOKEN`, both read when the download starts.

Offline once cached: a revision that is a commit SHA whose entry exists never calls the hub; a
branch or tag resolved before is remembered (`models/refs/<hash>`) and, if the hub cannot be
reached (or `HF_HUB_OFFLINE=1`), served from the entry it resolved to last time. Repositories
that hold only pickle weights (`*.bin`, `*.pt`) are refused before anything is downloaded.
While downloading, `progress("downloading", fraction, {"bytes_done", "bytes_total"})` reports the
bytes on disk every quarter second.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import os
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from magnitude.runner import model_cache

log = logging.getLogger("magnitude.runner.source")

HF_PREFIX = "hf://"
SHA_RE = re.compile(r"^[0-9a-f]{40}$")
# What a safetensors model needs to be loaded and served: nothing else is downloaded.
HF_ALLOW_PATTERNS = (
    "config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "vocab.txt", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.pkl", "*.ckpt")


class HubSourceError(ValueError):
    """The hub source cannot be served (bad syntax, unreachable and not cached, refused files)."""


@dataclass(frozen=True, slots=True)
class HubSpec:
    repo: str  # org/name
    revision: str  # as asked: branch, tag or SHA ("main" when omitted)
    gguf: str | None  # a GGUF file inside the repo, or None for a safetensors model

    @property
    def source(self) -> str:
        path = f"{self.repo}/{self.gguf}" if self.gguf else self.repo
        return f"{HF_PREFIX}{path}@{self.revision}"


@dataclass(frozen=True, slots=True)
class Downloaded:
    path: Path  # the cache entry (a model folder, or the folder holding the GGUF)
    sha: str  # the commit the files came from
    cache_hit: bool


def parse(source: str, revision: str | None = None) -> HubSpec:
    """`hf://org/name[/file.gguf][@rev]`; `revision` (the `--revision` flag) must agree with an `@rev`."""
    if not source.startswith(HF_PREFIX):
        raise HubSourceError(f"model source {source!r}: not an hf:// source")
    body, _, at_rev = source.removeprefix(HF_PREFIX).partition("@")
    parts = [p for p in body.split("/") if p]
    if len(parts) < 2 or any(p in (".", "..") for p in parts):
        raise HubSourceError(f"model source {source!r}: expected hf://org/name[/file.gguf][@revision]")
    gguf = "/".join(parts[2:]) or None
    if gguf is not None and not gguf.endswith(".gguf"):
        raise HubSourceError(f"model source {source!r}: a file inside the repository must be a .gguf")
    if at_rev and revision and at_rev != revision:
        raise HubSourceError(f"model source {source!r} names revision {at_rev!r} but --revision is {revision!r}")
    return HubSpec(f"{parts[0]}/{parts[1]}", at_rev or revision or "main", gguf)


def _key(spec: HubSpec, sha: str) -> str:
    digest = hashlib.sha256(f"{spec.repo}|{spec.gguf or ''}|{sha}".encode()).hexdigest()[:16]
    return f"hf-{spec.repo.replace('/', '--')}-{sha[:12]}-{digest}"


def _ref_file(spec: HubSpec) -> Path:
    digest = hashlib.sha256(f"{spec.repo}|{spec.gguf or ''}|{spec.revision}".encode()).hexdigest()[:24]
    return model_cache.models_dir() / "refs" / digest


def _remembered_sha(spec: HubSpec) -> str | None:
    if SHA_RE.match(spec.revision):
        return spec.revision
    try:
        sha = _ref_file(spec).read_text().strip()
    except OSError:
        return None
    return sha if SHA_RE.match(sha) else None


def _remember(spec: HubSpec, sha: str) -> None:
    ref = _ref_file(spec)
    ref.parent.mkdir(parents=True, exist_ok=True)
    # Unique per process and thread: two fetches in one process (a target and its draft, or the
    # tests' three threads) each rename their own file; one shared name lost the race.
    tmp = ref.with_suffix(f".tmp-{os.getpid()}-{threading.get_ident()}")
    tmp.write_text(sha)
    tmp.replace(ref)


def _choose_files(spec: HubSpec, siblings: list[tuple[str, int | None]]) -> list[tuple[str, int]]:
    names = {name: size or 0 for name, size in siblings}
    if spec.gguf is not None:
        if spec.gguf not in names:
            ggufs = sorted(n for n in names if n.endswith(".gguf"))
            raise HubSourceError(f"{spec.source}: no file {spec.gguf!r} in {spec.repo} (GGUF files: {ggufs[:10]})")
        return [(spec.gguf, names[spec.gguf])]
    chosen = [(n, s) for n, s in names.items() if "/" not in n and any(fnmatch.fnmatch(n, p) for p in HF_ALLOW_PATTERNS)]
    if not any(n.endswith(".safetensors") for n, _ in chosen):
        pickles = sorted(n for n in names if any(fnmatch.fnmatch(n, p) for p in PICKLE_PATTERNS))
        if pickles:
            raise HubSourceError(f"{spec.source}: weights are pickle files ({', '.join(pickles[:3])}); only "
                                 ".safetensors weights are loaded")
        raise HubSourceError(f"{spec.source}: no .safetensors weights in {spec.repo} (name a .gguf file to serve a GGUF)")
    if "config.json" not in names:
        raise HubSourceError(f"{spec.source}: {spec.repo} has no config.json")
    return sorted(chosen)


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _watch(folder: Path, total: int, progress: Callable[..., None], stop: threading.Event) -> None:
    while not stop.wait(0.25):
        done = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.exists() else 0
        progress("downloading", min(1.0, done / total) if total else 0.0,
                 {"bytes_done": min(done, total), "bytes_total": total})


def fetch(spec: HubSpec, progress: Callable[..., None], check_config: Callable[[Path], None] | None = None) -> Downloaded:
    """The cache entry holding `spec`'s files, downloading them at the resolved SHA on a miss.
    `check_config(folder)` sees the repository's config.json alone first, so a model that cannot
    be served is refused before its weights are downloaded."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    endpoint = os.environ.get("HF_ENDPOINT") or None
    token = os.environ.get("HF_TOKEN") or None
    root = model_cache.models_dir()
    sha = _remembered_sha(spec)
    if sha is not None and (SHA_RE.match(spec.revision) or _hub_offline()):
        entry = root / _key(spec, sha)
        if model_cache.is_complete(entry):
            model_cache.touch(entry)
            return Downloaded(entry, sha, True)
    if _hub_offline():
        raise HubSourceError(f"{spec.source}: HF_HUB_OFFLINE is set and the model is not in the cache ({root})")

    api = HfApi(endpoint=endpoint, token=token)
    try:
        info = api.model_info(spec.repo, revision=spec.revision, files_metadata=True)
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise HubSourceError(f"{spec.source}: {type(e).__name__}: {str(e).splitlines()[0]}") from e
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            raise HubSourceError(f"{spec.source}: the hub refused access ({status}); set HF_TOKEN to a token "
                                 "that can read this repository") from e
        if status is not None and status < 500:
            raise HubSourceError(f"{spec.source}: the hub answered {status}: {str(e).splitlines()[-1]}") from e
        return _offline_fallback(spec, e)  # the hub is down or failing: the cache may still serve
    except Exception as e:  # noqa: BLE001 - connection refused, DNS, timeouts: try the cache
        return _offline_fallback(spec, e)
    sha = str(info.sha)
    files = _choose_files(spec, [(s.rfilename, getattr(s, "size", None)) for s in (info.siblings or [])])
    entry = root / _key(spec, sha)
    with model_cache.locked(entry):
        if model_cache.is_complete(entry):
            _remember(spec, sha)
            model_cache.touch(entry)
            return Downloaded(entry, sha, True)
        if check_config is not None and spec.gguf is None:
            with tempfile.TemporaryDirectory(dir=root) as cfg_dir:
                hf_hub_download(spec.repo, "config.json", revision=sha, local_dir=cfg_dir, endpoint=endpoint, token=token)
                check_config(Path(cfg_dir))
        total = sum(size for _, size in files)
        progress("downloading", 0.0, {"bytes_done": 0, "bytes_total": total})

        def fill(tmp: Path) -> None:
            stop = threading.Event()
            watcher = threading.Thread(target=_watch, args=(tmp, total, progress, stop), daemon=True)
            watcher.start()
            try:
                snapshot_download(spec.repo, revision=sha, allow_patterns=[name for name, _ in files], local_dir=tmp,
                                  endpoint=endpoint, token=token, max_workers=4)
            finally:
                stop.set()
                watcher.join()
            shutil.rmtree(tmp / ".cache", ignore_errors=True)  # huggingface_hub's download metadata
            missing = [name for name, _ in files if not (tmp / name).is_file()]
            if missing:
                raise HubSourceError(f"{spec.source}: download incomplete, missing {missing}")

        model_cache.write_entry(entry, fill, {"source": spec.source, "repo": spec.repo, "revision": sha,
                                              "files": [name for name, _ in files]})
        progress("downloading", 1.0, {"bytes_done": total, "bytes_total": total})
    _remember(spec, sha)
    model_cache.touch(entry)
    model_cache.cleanup(entry)
    return Downloaded(entry, sha, False)


def _offline_fallback(spec: HubSpec, error: Exception) -> Downloaded:
    sha = _remembered_sha(spec)
    if sha is not None:
        entry = model_cache.models_dir() / _key(spec, sha)
        if model_cache.is_complete(entry):
            log.warning("hub unreachable (%s); serving %s from the cache at %s", error, spec.source, sha)
            model_cache.touch(entry)
            return Downloaded(entry, sha, True)
    raise HubSourceError(f"{spec.source}: the hub cannot be reached ({type(error).__name__}: {error}) and the "
                         "model is not in the cache") from error
