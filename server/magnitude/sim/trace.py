"""Traces: JSONL, one request a line (DESIGN §3). Reading validates every line and names the
line in its error; writing is atomic (a temp file renamed into place).

`{"id": "a", "arrival": 0.0, "prompt_tokens": 24, "output_tokens": 4, "priority_class": "interactive",
  "tenant": "t1", "cancel_at": null, "deadline": null, "prompt": null}`
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the file and line."""


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

    def to_line(self) -> str:
        return json.dumps(self.model_dump(mode="json"), separators=(", ", ": "))


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
