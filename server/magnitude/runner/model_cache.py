"""The on-disk model cache: `$MAGNITUDE_CACHE/models/<key>/`, one folder per downloaded or converted model.

An entry is complete once it exists under its final name: writers fill a temporary sibling folder
and rename it into place, so a reader never sees half a model. Writers of the same key serialize on
a lock file (`<key>.lock`, `flock`), so two pods on one volume download or convert once; the second
finds the entry when it gets the lock. Each use touches the entry's marker file, and after a new
entry is written the oldest entries by that mtime are removed while there are more than
`MAGNITUDE_CACHE_MAX_ENTRIES` (default 8) or they hold more than `MAGNITUDE_CACHE_MAX_BYTES`
(default unbounded) — never the entry just used, and never one whose lock another process holds.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

log = logging.getLogger("magnitude.runner.cache")

MARKER = "magnitude-source.json"  # written last into every entry: what it holds and where it came from
DEFAULT_MAX_ENTRIES = 8


def cache_root() -> Path:
    """`$MAGNITUDE_CACHE`, else `~/.cache/magnitude` (quantization records live beside `models/`)."""
    return Path(os.environ.get("MAGNITUDE_CACHE") or Path.home() / ".cache" / "magnitude")


def models_dir() -> Path:
    return cache_root() / "models"


def is_complete(entry: Path) -> bool:
    return (entry / MARKER).is_file()


@contextmanager
def locked(entry: Path) -> Iterator[None]:
    """Hold `<entry>.lock` exclusively (blocks while another process writes the same entry)."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(entry.parent / f"{entry.name}.lock", "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def touch(entry: Path) -> None:
    """Mark the entry used now (the cleanup removes the least recently used first)."""
    try:
        os.utime(entry / MARKER)
    except OSError:
        pass  # a read-only cache volume still serves; it just is not cleaned by use


def write_entry(entry: Path, fill: Callable[[Path], None], marker: dict) -> None:
    """Build the entry in a temporary folder beside it (`fill(tmp)`), write the marker, rename it
    into place. Call while holding `locked(entry)`."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=entry.name + ".tmp-", dir=entry.parent))
    tmp.chmod(0o755)
    try:
        fill(tmp)
        (tmp / MARKER).write_text(json.dumps(marker))
        try:
            tmp.rename(entry)
        except OSError:
            # Another writer without our lock (an older engine) finished first; theirs is as good.
            if not (entry / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _lock_free(entry: Path) -> bool:
    lock = entry.parent / f"{entry.name}.lock"
    if not lock.exists():
        return True
    with open(lock, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        fcntl.flock(fh, fcntl.LOCK_UN)
        return True


def cleanup(keep: Path, max_entries: int | None = None, max_bytes: int | None = None) -> list[Path]:
    """Remove least recently used complete entries beyond the bounds; returns what was removed.
    Stale temporary folders (a writer killed mid-way, over an hour old) go too."""
    if max_entries is None:
        max_entries = int(os.environ.get("MAGNITUDE_CACHE_MAX_ENTRIES") or DEFAULT_MAX_ENTRIES)
    if max_bytes is None and os.environ.get("MAGNITUDE_CACHE_MAX_BYTES"):
        max_bytes = int(os.environ["MAGNITUDE_CACHE_MAX_BYTES"])
    root = keep.parent
    removed: list[Path] = []
    now = time.time()
    for tmp in root.glob("*.tmp-*"):
        try:
            if tmp.is_dir() and now - tmp.stat().st_mtime > 3600:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass
    entries = [e for e in root.iterdir() if e.is_dir() and is_complete(e)]
    entries.sort(key=lambda e: (e / MARKER).stat().st_mtime, reverse=True)  # newest first
    sizes = {e: _size(e) for e in entries} if max_bytes is not None else {}
    kept, total = 0, 0
    for e in entries:
        kept += 1
        total += sizes.get(e, 0)
        over = kept > max_entries or (max_bytes is not None and total > max_bytes)
        if not over or e == keep:
            continue
        if not _lock_free(e):
            continue  # being written or read under lock by another process
        log.info("model cache: removing least recently used %s", e.name)
        shutil.rmtree(e, ignore_errors=True)
        kept -= 1
        total -= sizes.get(e, 0)
        removed.append(e)
    return removed
