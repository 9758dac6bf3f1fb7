"""Traces: JSONL, one request a line (DESIGN §3). Reading validates every line and names the
line in its error; writing is atomic (a temp file renamed into place).

`{"id": "a", "arrival": 0.0, "prompt_tokens": 24, "output_tokens": 4, "priority_class": "interactive",
  "tenant": "t1", "cancel_at": null, "deadline": null, "prompt": null}`

Recorded traces (`magnitude serve --record-trace`) may also carry `preparation` (seconds from the
HTTP arrival until the request reached the scheduler's queue: tokenization, template, waiting for
the model to load) and `prefix_groups` with `prefix_block_size`: the hashes of the prompt's
leading 1, 2, 4, 8, ... full blocks of `prefix_block_size` tokens (chained, seeded by the engine's
prefix-cache isolation key), so requests that share leading blocks share those hashes. The
simulator turns them into token ids (`prefix_token_ids`) and its prefix cache does the rest.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the file and line."""


_RECORDED_ONLY = ("preparation", "prefix_groups", "prefix_block_size")


class TraceRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=256)
    arrival: float = Field(ge=0.0, allow_inf_nan=False)
    prompt_tokens: int = Field(ge=1, le=10_000_000)
    output_tokens: int = Field(ge=1, le=10_000_000)
    priority_class: str | None = None
    tenant: str | None = Field(default=None, min_length=1, max_length=253)
    cancel_at: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    deadline: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    prompt: str | None = None
    preparation: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    prefix_groups: list[str] | None = Field(default=None, max_length=64)
    prefix_block_size: int | None = Field(default=None, ge=1, le=1024)

    @model_validator(mode="after")
    def _prefix_pair(self) -> "TraceRecord":
        if (self.prefix_groups is None) != (self.prefix_block_size is None):
            raise ValueError("prefix_groups and prefix_block_size go together")
        return self

    def to_line(self) -> str:
        doc = self.model_dump(mode="json")
        for key in _RECORDED_ONLY:  # written when set: generated traces keep their shape
            if doc[key] is None:
                del doc[key]
        return json.dumps(doc, separators=(", ", ": "))


def prefix_token_ids(rec: TraceRecord, vocab: int = 32_000) -> list[int] | None:
    """Synthetic prompt token ids that share exactly what the record's prefix groups say: the
    tokens between the (i-1)-th and i-th ladder point come from the i-th hash, the rest from the
    request's id (unique). None without prefix groups."""
    if not rec.prefix_groups or rec.prefix_block_size is None:
        return None
    ids: list[int] = []
    bs = rec.prefix_block_size
    for i, group in enumerate(rec.prefix_groups):
        end = min(bs * (1 << i), rec.prompt_tokens)
        rng = random.Random(group)
        ids.extend(rng.randrange(vocab) for _ in range(end - len(ids)))
    rng = random.Random(f"tail|{rec.id}")
    ids.extend(rng.randrange(vocab) for _ in range(rec.prompt_tokens - len(ids)))
    return ids


def parse_trace(lines: Iterable[str], source: str = "trace") -> list[TraceRecord]:
    records: list[TraceRecord] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{source}:{lineno}: not valid JSON: {e.msg}") from e
        if not isinstance(raw, dict):
            raise TraceError(f"{source}:{lineno}: expected a JSON object, got {type(raw).__name__}")
        try:
            rec = TraceRecord.model_validate(raw)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(str(p) for p in x['loc']) or '(line)'}: {x['msg']}" for x in e.errors())
            raise TraceError(f"{source}:{lineno}: {problems}") from e
        if rec.id in seen:
            raise TraceError(f"{source}:{lineno}: id: duplicate id {rec.id!r} (first on line {seen[rec.id]})")
        seen[rec.id] = lineno
        records.append(rec)
    if not records:
        raise TraceError(f"{source}: the trace has no requests")
    return records


def load_trace(path: str | Path) -> list[TraceRecord]:
    try:
        with open(path, encoding="utf-8") as f:
            return parse_trace(f, str(path))
    except OSError as e:
        raise TraceError(f"{path}: cannot read trace: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: not UTF-8 text") from e


def write_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` so a reader sees the old file or the whole new one, never half."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent if str(p.parent) else ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def dump_trace(records: Iterable[TraceRecord]) -> str:
    return "".join(r.to_line() + "\n" for r in records)


def write_trace(records: Iterable[TraceRecord], path: str | Path | None = None, out: IO[str] | None = None) -> None:
    text = dump_trace(records)
    if path is None or str(path) == "-":
        (out or sys.stdout).write(text)
    else:
        write_atomic(path, text)
