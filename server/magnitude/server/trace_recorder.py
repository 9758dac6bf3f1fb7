"""Recording live traffic as a simulator trace (`magnitude serve --record-trace`, `recordTrace`).

Owns the trace file: one JSONL line per request (the simulator's `TraceRecord`) written when the
request ends, bounded in size and rotated (PATH, then PATH.1 newest ... PATH.<keep>), tenant names
hashed unless asked, no text unless asked. The engine loop only appends a tuple to a queue
(`record`); hashing the prefix, rendering and writing happen on this module's own thread, so a
slow or failing disk never blocks a step. A write failure is logged (once per failure streak)
and the record dropped: serving goes on. The queue is bounded too: while the writer cannot keep
up, new records are dropped and counted.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from magnitude.policy.schema import RecordTracePolicy
from magnitude.sim.trace import TraceRecord

log = logging.getLogger("magnitude.trace_recorder")

MAX_PENDING = 10_000  # records waiting for the writer; beyond this they are dropped, not buffered
MAX_LADDER = 20  # prefix groups at 1, 2, 4, ... 2^19 blocks: longer prompts share at most that much
_STOP = object()


class TraceRecordError(ValueError):
    """recordTrace cannot be used (its directory is missing or not writable)."""


def tenant_hash(name: str) -> str:
    """A stable pseudonym: the same tenant always maps to the same name (not anonymous: a guessed
    name can be checked against it)."""
    return "t-" + hashlib.sha256(name.encode()).hexdigest()[:16]


def prefix_groups(token_ids: list[int], block_size: int, isolation_key: str) -> list[str]:
    """Chained hashes of the leading 1, 2, 4, ... full blocks, seeded by the prefix cache's
    isolation key (two tenants' identical prompts share no cached blocks, so no groups either)."""
    h = hashlib.sha256(isolation_key.encode())
    out: list[str] = []
    full = len(token_ids) // block_size
    next_point = 1
    for b in range(full):
        block = token_ids[b * block_size:(b + 1) * block_size]
        h.update(b"|" + ",".join(map(str, block)).encode())
        if b + 1 == next_point:
            out.append(h.hexdigest()[:16])
            next_point *= 2
            if len(out) == MAX_LADDER:
                break
    return out


@dataclass(slots=True)
class Ended:
    """What the engine hands over when a request ends (cheap to build on the loop thread)."""

    request_id: str
    arrival: float  # engine clock
    queued: float | None  # engine clock when it entered the scheduler's queue
    prompt_token_ids: list[int]
    output_tokens: int
    priority_class: str
    tenant: str
    status: str  # finished | cancelled | rejected | timed_out | failed
    end: float
    deadline: float | None
    isolation_key: str
    extra: dict[str, Any] = field(default_factory=dict)


class TraceRecorder:
    def __init__(
        self,
        policy: RecordTracePolicy,
        origin: float,
        block_size: int,
        detokenize: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.policy = policy
        self.path = Path(policy.path)
        self.origin = origin  # engine-clock time 0 of the trace
        self.block_size = block_size
        self.detokenize = detokenize
        self.written = 0
        self.dropped = 0
        self.write_errors = 0
        self._failing = False
        self._queue: queue.Queue[Any] = queue.Queue()
        parent = self.path.parent if str(self.path.parent) else Path(".")
        if not parent.is_dir():
            raise TraceRecordError(f"recordTrace.path {policy.path}: directory {parent} does not exist")
        if not os.access(parent, os.W_OK):
            raise TraceRecordError(f"recordTrace.path {policy.path}: directory {parent} is not writable")
        self._file: Any = None
        self._size = 0
        self._thread = threading.Thread(target=self._run, name="magnitude-trace-writer", daemon=True)
        self._thread.start()

    # -- any thread -----------------------------------------------------------------------------
    def record(self, ended: Ended) -> None:
        """Queue one ended request; never blocks, never raises."""
        if self._queue.qsize() >= MAX_PENDING:
            self.dropped += 1
            return
        self._queue.put(ended)

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until everything queued so far is written (tests, shutdown)."""
        done = threading.Event()
        self._queue.put(done)
        done.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout)

    # -- the writer thread ----------------------------------------------------------------------
    def to_record(self, e: Ended) -> TraceRecord:
        p = self.policy
        t0 = self.origin
        arrival = max(0.0, e.arrival - t0)
        if e.status == "finished":
            outputs = e.output_tokens
        else:
            # It did not run to its end: what it would have generated is unknown; at least one more
            # than it did (a cancelled one stops at cancel_at in the replay anyway), else the estimate.
            outputs = max(e.output_tokens + 1, int(e.extra.get("expected_output_tokens", 1)))
        groups = prefix_groups(e.prompt_token_ids, self.block_size, e.isolation_key)
        return TraceRecord(
            id=e.request_id,
            arrival=round(arrival, 6),
            prompt_tokens=max(1, len(e.prompt_token_ids)),
            output_tokens=max(1, outputs),
            priority_class=e.priority_class or None,
            tenant=(tenant_hash(e.tenant) if p.hash_tenants else e.tenant) if e.tenant else None,
            cancel_at=round(max(arrival, e.end - t0), 6) if e.status == "cancelled" else None,
            deadline=round(max(0.0, e.deadline - t0), 6) if e.deadline is not None else None,
            prompt=self.detokenize(e.prompt_token_ids) if p.include_text and self.detokenize else None,
            preparation=round(max(0.0, e.queued - e.arrival), 6) if e.queued is not None else None,
            prefix_groups=groups or None,
            prefix_block_size=self.block_size if groups else None,
        )

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                self._close_file()
                return
            if isinstance(item, threading.Event):
                self._sync()
                item.set()
                continue
            try:
                line = self.to_record(item).to_line() + "\n"
                self._write(line.encode())
                self.written += 1
                self._failing = False
            except Exception as exc:  # noqa: BLE001 - a failing disk must not hurt serving
                self.write_errors += 1
                self.dropped += 1
                if not self._failing:
                    log.error("recordTrace: writing %s failed (%s); dropping records until it works again",
                              self.path, exc)
                self._failing = True
                self._close_file()
            if self._queue.empty():
                self._sync()

    def _write(self, data: bytes) -> None:
        if self._file is not None and self._size and self._size + len(data) > self.policy.max_bytes:
            self._rotate()
        if self._file is None:
            self._file = open(self.path, "ab")  # noqa: SIM115 - kept open across records
            self._size = self._file.tell()
            if self._size and self._size + len(data) > self.policy.max_bytes:
                self._rotate()
                self._file = open(self.path, "ab")  # noqa: SIM115
                self._size = 0
        self._file.write(data)
        self._size += len(data)

    def _rotate(self) -> None:
        self._close_file()
        keep = self.policy.keep
        for i in range(keep, 0, -1):
            src = self.path if i == 1 else self.path.with_name(f"{self.path.name}.{i - 1}")
            if src.exists():
                os.replace(src, self.path.with_name(f"{self.path.name}.{i}"))
        if keep == 0:
            self.path.unlink(missing_ok=True)

    def _sync(self) -> None:
        if self._file is not None:
            try:
                self._file.flush()
            except OSError as exc:
                self.write_errors += 1
                log.error("recordTrace: flushing %s failed (%s)", self.path, exc)
                self._close_file()

    def _close_file(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None
            self._size = 0
