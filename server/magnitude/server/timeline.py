"""Request records: each request's timeline and timing breakdown, and the scheduler's decision log.

This module owns what the server remembers about what happened, and nothing else (it decides
nothing, streams nothing, exports nothing to Prometheus by itself):

- one `RequestTimeline` per request the engine saw: the ordered record of what happened to it —
  `arrival` (the HTTP request), `loading` (waited for the model), `preparation` (validation,
  template, tokenization), `queued` (admission accepted) or `reject` (with the reason),
  `admit`, `prefix_cache_hit`, each `prefill_chunk` (tokens, start, step), `first_token`,
  `defer`, `preempt` (mode, reason), `swap_out`/`swap_in`, the resume with the time lost,
  `cancel`/`timeout`/`finish` and `release` — and the timing breakdown the response carries;
- the decision log: every scheduler decision (plus the engine's `shed` changes) with a sequence
  number, served by `GET /debug/decisions?since=SEQ`, and a count per (kind, reason).

It is not a second event system: every entry except arrival, loading, preparation, queued,
prefill_chunk, prefix_cache_hit and first_token is a `SchedulerEvent` the scheduler already
emitted, filed under its request. The engine feeds it under the engine loop's lock —
`observe_step` once per step, costing O(events) plus O(sequences in the step) only while some
request is prefilling (a step of plain decodes walks no sequence), never O(all requests) —
and the HTTP layer and the metrics adapter read it; its own lock makes those reads safe.

Timing adds up by construction: arrival -> enqueued is loading + preparation, enqueued -> first
admission is queue, first admission -> first token is prefill, first token -> end is decode, and
the intervals a request spent preempted (preempt -> resume) are cut out of prefill or decode and
reported as preempted. All are differences of one clock's timestamps, so queue + loading +
preparation + prefill + decode + preempted = e2e up to rounding.

Bounds: live requests are always kept (admission bounds how many there are); finished ones go to
a ring of `max_requests`; a timeline keeps `max_events_per_request` entries and counts the rest as
`dropped_events`; the decision log keeps `max_decisions`; decision counts keep `MAX_REASON_LABELS`
(kind, reason) pairs, the rest count as reason `other` (one per kind).

Times in documents: a timeline's `t` is seconds since the request arrived; a decision's `t` is
seconds on the engine's clock since the log was created.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from magnitude.engine.events import SchedulerEvent
from magnitude.engine.output import RequestUpdate, StepPlan

log = logging.getLogger("magnitude.timeline")

DEFAULT_MAX_REQUESTS = 1000
DEFAULT_MAX_DECISIONS = 10_000
DEFAULT_MAX_EVENTS_PER_REQUEST = 512
MAX_REASON_LABELS = 128
MAX_CLIENT_ID_CHARS = 128
# Scheduler events after which a preempted request runs again: the end of a preempted interval.
_RESUME = {("admit", "resumed"), ("swap_in", "blocks_available")}


def reason_label(reason: str) -> str:
    """The bounded part of a reason: detail after ':' ("too_long:5000>4096", "error: ...") is dropped."""
    return (reason.split(":", 1)[0].strip() or "none")[:64]


@dataclass(slots=True)
class TimelineEvent:
    t: float  # engine clock seconds
    kind: str
    reason: str
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class RequestTimeline:
    """What happened to one request, and the timestamps its timing is computed from."""

    request_id: str
    arrival: float  # the HTTP request arrived
    enqueued: float  # handed to admission (preparation done)
    loading_s: float
    prompt_tokens: int
    priority_class: str
    tenant: str
    client_id: str | None = None
    status: str = "queued"  # queued | running | preempted | finished | rejected | cancelled | timed_out | failed
    events: list[TimelineEvent] = field(default_factory=list)
    dropped_events: int = 0
    admitted: float | None = None  # first admission into a step
    first_token: float | None = None
    end: float | None = None
    cached_prompt_tokens: int | None = None  # served from the prefix cache at first admission
    preempted_since: float | None = None  # open preempted interval
    preempted_s: float = 0.0  # closed preempted intervals
    preempted_before_first_token_s: float = 0.0
    mean_itl_ms: float | None = None
    # Longest gap between consecutive output tokens as the engine emitted them: the stall the
    # scheduler answers for, apart from text a client's stream holds back (a token that does not yet
    # end a character or word reaches the client with the next one).
    max_itl_ms: float | None = None
    prefilled: int = 0  # highest prompt position a chunk reached
    spec_acceptance: float | None = None  # accepted / proposed draft tokens; None: speculation never ran
    max_burst_tokens: int | None = None  # most tokens that landed in one step (> 1 only under speculation)

    def timing(self, now: float) -> dict[str, float | int | None]:
        """The response's `timing`; a live request is measured up to `now`. None = phase not reached."""
        end = self.end if self.end is not None else now
        open_s = end - self.preempted_since if self.preempted_since is not None else 0.0
        preempted = self.preempted_s + open_s
        before_first = self.preempted_before_first_token_s + (open_s if self.first_token is None else 0.0)
        prefill = decode = None
        if self.admitted is not None:
            prefill = (self.first_token if self.first_token is not None else end) - self.admitted - before_first
        if self.first_token is not None:
            decode = end - self.first_token - (preempted - before_first)
        ms = _ms
        return {
            "queue_time_ms": ms((self.admitted if self.admitted is not None else end) - self.enqueued),
            "ttft_ms": None if self.first_token is None else ms(self.first_token - self.arrival),
            "mean_itl_ms": self.mean_itl_ms,
            "max_itl_ms": self.max_itl_ms,
            "e2e_ms": ms(end - self.arrival),
            "loading_ms": ms(self.loading_s),
            "preparation_ms": ms(self.enqueued - self.arrival - self.loading_s),
            "prefill_ms": None if prefill is None else ms(prefill),
            "decode_ms": None if decode is None else ms(decode),
            "preempted_ms": ms(preempted),
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "spec_acceptance": self.spec_acceptance,
            "max_burst_tokens": self.max_burst_tokens,
        }

    def to_document(self, now: float) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "client_request_id": self.client_id,
            "status": self.status,
            "priority_class": self.priority_class,
            "tenant": self.tenant,
            "prompt_tokens": self.prompt_tokens,
            "events": [
                {"t": round(e.t - self.arrival, 6), "kind": e.kind, "reason": e.reason, **e.detail} for e in self.events
            ],
            "dropped_events": self.dropped_events,
            "timing": self.timing(now),
        }


def _ms(seconds: float) -> float:
    return round(max(0.0, seconds) * 1000.0, 3)


class RequestLog:
    """Timelines of live and recent requests, and the decision log. See the module docstring."""

    def __init__(
        self,
        clock: Callable[[], float],
        max_requests: int = DEFAULT_MAX_REQUESTS,
        max_decisions: int = DEFAULT_MAX_DECISIONS,
        max_events_per_request: int = DEFAULT_MAX_EVENTS_PER_REQUEST,
    ) -> None:
        if max_requests < 1 or max_decisions < 1 or max_events_per_request < 8:
            raise ValueError("request log sizes: max_requests and max_decisions >= 1, max_events_per_request >= 8")
        self.clock = clock
        self.origin = clock()
        self.max_requests = max_requests
        self.max_events_per_request = max_events_per_request
        self._lock = threading.Lock()
        self._live: dict[str, RequestTimeline] = {}
        self._recent: OrderedDict[str, RequestTimeline] = OrderedDict()  # finished, oldest first
        self._aliases: dict[str, str] = {}  # client X-Request-Id -> request id (latest wins)
        self._decisions: deque[tuple[int, SchedulerEvent]] = deque(maxlen=max_decisions)
        self._next_seq = 0
        self._counts: dict[tuple[str, str], int] = {}
        # Live requests admitted and still prefilling (prompt or recompute): only these have chunks
        # and first tokens to file, so a step of plain decodes touches no sequence (see observe_step).
        self._prefilling: set[str] = set()

    # -- writing (engine) ---------------------------------------------------------------------------
    def open(
        self,
        request_id: str,
        *,
        arrival: float,
        enqueued: float,
        prompt_tokens: int,
        priority_class: str,
        tenant: str,
        loading_s: float = 0.0,
        client_id: str | None = None,
    ) -> RequestTimeline:
        rec = RequestTimeline(request_id, arrival, enqueued, loading_s, prompt_tokens, priority_class, tenant, client_id)
        with self._lock:
            self._live[request_id] = rec
            if client_id:
                self._aliases[client_id] = request_id
            self._add(rec, TimelineEvent(arrival, "arrival", "http"))
            if loading_s > 0:
                self._add(rec, TimelineEvent(arrival + loading_s, "loading", "model_not_ready", {"ms": _ms(loading_s)}))
            self._add(rec, TimelineEvent(enqueued, "preparation", "tokenized",
                                         {"ms": _ms(enqueued - arrival - loading_s), "prompt_tokens": prompt_tokens}))
        return rec

    def queued(self, request_id: str, t: float, position: int | None) -> None:
        with self._lock:
            rec = self._live.get(request_id)
            if rec is not None:
                self._add(rec, TimelineEvent(t, "queued", "accepted", {"position": position}))

    def observe_step(
        self, start: float, end: float, plan: StepPlan | None, events: Iterable[SchedulerEvent], updates: Iterable[RequestUpdate]
    ) -> None:
        """File one step: the scheduler's decisions taken when the step was planned (t <= start),
        the prefill chunks it ran, the first tokens it produced, then the decisions taken after it
        (finish at `end`). In that order, so each timeline reads in the order things happened."""
        with self._lock:
            later: list[SchedulerEvent] = []
            for ev in events:
                if ev.t > start:
                    later.append(ev)
                else:
                    self._decision(ev)
            sampling = self._chunks(plan, start) if plan is not None and self._prefilling else set()
            if sampling:
                self._first_tokens(sampling, updates, end)
            for ev in later:
                self._decision(ev)

    def shed(self, t: float, classes: list[str]) -> None:
        """The engine changed the shed set: a decision with no request."""
        with self._lock:
            self._decision(SchedulerEvent(t, "shed", "", "admin" if classes else "off", {"classes": list(classes)}))

    def close(self, request_id: str, status: str, end: float, token_times: list[float],
              spec_acceptance: float | None = None) -> dict[str, float | int | None]:
        """The request ended: freeze its timing and move it to the ring of recent requests.
        ITL is per token: tokens that landed together in one step (accepted drafts) count as
        separate gaps of 0, and the largest such burst is reported as `max_burst_tokens`; the
        longest gap (a preempted interval included) as `max_itl_ms`."""
        with self._lock:
            rec = self._live.pop(request_id, None)
            self._prefilling.discard(request_id)
            if rec is None:
                rec = self._recent.get(request_id)
                return rec.timing(end) if rec is not None else {}
            rec.status, rec.end = status, end
            rec.spec_acceptance = spec_acceptance
            if token_times:
                rec.max_burst_tokens = max(Counter(token_times).values())
            if len(token_times) >= 2:
                rec.mean_itl_ms = round((token_times[-1] - token_times[0]) / (len(token_times) - 1) * 1000.0, 3)
                rec.max_itl_ms = round(max(b - a for a, b in zip(token_times, token_times[1:])) * 1000.0, 3)
            self._recent[request_id] = rec
            while len(self._recent) > self.max_requests:
                _, old = self._recent.popitem(last=False)
                if old.client_id and self._aliases.get(old.client_id) == old.request_id:
                    del self._aliases[old.client_id]
            return rec.timing(end)

    def enqueued_at(self, request_id: str) -> float | None:
        with self._lock:
            rec = self._live.get(request_id)
            return None if rec is None else rec.enqueued

    # -- reading (HTTP, metrics) ----------------------------------------------------------------------
    def find(self, some_id: str) -> dict[str, Any] | None:
        """By request id (the `X-Request-Id` the server returns), by the response's `id`
        (`chatcmpl-X` / `cmpl-X` name request `cmpl-X`), or by a client-supplied `X-Request-Id`."""
        now = self.clock()
        with self._lock:
            for key in (some_id, "cmpl-" + some_id.split("-", 1)[-1], self._aliases.get(some_id)):
                if key is None:
                    continue
                rec = self._live.get(key) or self._recent.get(key)
                if rec is not None:
                    return rec.to_document(now)
        return None

    def decisions(self, since: int = 0, limit: int = 1000) -> dict[str, Any]:
        """Decisions with seq >= since (at most `limit`), oldest first; `next` is the `since` of the
        following call; `dropped` counts decisions after `since` that the ring no longer holds."""
        with self._lock:
            first = self._decisions[0][0] if self._decisions else self._next_seq
            start = max(since, first)
            dropped = max(0, first - max(since, 0))
            out = []
            for i in range(start - first, min(len(self._decisions), start - first + limit)):
                seq, ev = self._decisions[i]
                out.append({"seq": seq, "t": round(ev.t - self.origin, 6), "kind": ev.kind,
                            "request": ev.request_id or None, "reason": ev.reason, **ev.detail})
            # Nothing new: the caller asks again from where it stands (or from ours, if it is ahead of
            # this process, e.g. after a restart).
            nxt = out[-1]["seq"] + 1 if out else min(start, self._next_seq)
            return {"decisions": out, "next": nxt, "dropped": dropped}

    def decision_counts(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)

    def __len__(self) -> int:
        with self._lock:
            return len(self._live) + len(self._recent)

    # -- inside the lock ------------------------------------------------------------------------------
    def _add(self, rec: RequestTimeline, ev: TimelineEvent) -> None:
        if len(rec.events) < self.max_events_per_request:
            rec.events.append(ev)
        else:
            rec.dropped_events += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request_event %s", json.dumps(
                {"request": rec.request_id, "t": round(ev.t - rec.arrival, 6), "kind": ev.kind, "reason": ev.reason, **ev.detail},
                separators=(",", ":"), default=str))

    def _decision(self, ev: SchedulerEvent) -> None:
        self._decisions.append((self._next_seq, ev))
        self._next_seq += 1
        key = (ev.kind, reason_label(ev.reason))
        if key not in self._counts and len(self._counts) >= MAX_REASON_LABELS:
            key = (ev.kind, "other")
        self._counts[key] = self._counts.get(key, 0) + 1
        if not ev.request_id:
            return
        rec = self._live.get(ev.request_id) or self._recent.get(ev.request_id)
        if rec is None:
            return
        detail = dict(ev.detail)
        if ev.kind == "preempt" and rec.preempted_since is None:
            rec.preempted_since = ev.t
            rec.status = "preempted"
        elif (ev.kind, ev.reason) in _RESUME and rec.preempted_since is not None:
            lost = ev.t - rec.preempted_since
            detail["lost_ms"] = _ms(lost)  # the time this preemption cost: off the device until now
            rec.preempted_s += lost
            if rec.first_token is None:
                rec.preempted_before_first_token_s += lost
            rec.preempted_since = None
        if ev.kind in ("admit", "swap_in"):
            rec.status = "running"
        if ev.kind == "admit" and ev.request_id in self._live:
            self._prefilling.add(ev.request_id)  # a fresh prefill, or a recompute after a preemption
        elif ev.kind == "preempt":
            self._prefilling.discard(ev.request_id)
        self._add(rec, TimelineEvent(ev.t, ev.kind, ev.reason, detail))
        if ev.kind == "admit":
            cached = int(detail.get("cached_tokens", 0) or 0)
            if rec.admitted is None:
                rec.admitted, rec.cached_prompt_tokens = ev.t, cached
            if cached:
                self._add(rec, TimelineEvent(ev.t, "prefix_cache_hit", ev.reason, {"tokens": cached}))

    def _chunks(self, plan: StepPlan, start: float) -> set[str]:
        """File the step's prefill chunks; return the requests whose chunk reached the end of their
        tokens without a first token yet (the runner sampled their first one in this step)."""
        prefilling = self._prefilling
        sampling: set[str] = set()
        for seq in plan.seqs:
            if seq.request_id not in prefilling:  # a plain decode: most of a step, never a chunk
                continue
            rec = self._live.get(seq.request_id)
            if rec is None:
                prefilling.discard(seq.request_id)
                continue
            # Work done before (outputs exist, or positions below what was already prefilled) is a
            # recompute after a preemption; the rest is prompt.
            end = seq.start_position + seq.num_tokens
            reason = "recompute" if seq.num_output_tokens > 0 or seq.start_position < rec.prefilled else "prompt"
            rec.prefilled = max(rec.prefilled, end)
            self._add(rec, TimelineEvent(start, "prefill_chunk", reason,
                                         {"tokens": seq.num_tokens, "start": seq.start_position, "step": plan.step_id}))
            if seq.sample:  # the last chunk: from the next step on it decodes
                prefilling.discard(seq.request_id)
                if rec.first_token is None:
                    sampling.add(seq.request_id)
        return sampling

    def _first_tokens(self, sampling: set[str], updates: Iterable[RequestUpdate], end: float) -> None:
        # Updates follow the plan's order (decodes first, chunks last): from the end, the few
        # requests that sampled their first token are found without walking the decodes.
        left = set(sampling)
        for upd in reversed(updates) if isinstance(updates, list) else updates:
            if upd.request_id not in left:
                continue
            left.discard(upd.request_id)
            rec = self._live.get(upd.request_id)
            if rec is not None and rec.first_token is None and upd.new_token_ids:
                rec.first_token = end
                self._add(rec, TimelineEvent(end, "first_token", "sampled"))
            if not left:
                return


# -- the HTTP edge of the record -------------------------------------------------------------------
ARRIVAL_KEY = "magnitude_arrival"


class ArrivalStamp:
    """ASGI middleware: stamps `scope["state"][ARRIVAL_KEY]` with the engine clock when the request
    arrives, before its body is read or validated, so preparation is measured from there."""

    def __init__(self, app: Any, clock: Callable[[], float]) -> None:
        self.app = app
        self.clock = clock

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})[ARRIVAL_KEY] = self.clock()
        await self.app(scope, receive, send)


def arrival_of(scope: dict[str, Any]) -> float | None:
    return scope.get("state", {}).get(ARRIVAL_KEY)


def client_request_id(value: str | None) -> str | None:
    """A client's X-Request-Id, kept as an alias of the request; ValueError if it cannot be one."""
    if value is None or not value.strip():
        return None
    value = value.strip()
    if len(value) > MAX_CLIENT_ID_CHARS or not value.isprintable():
        raise ValueError(f"X-Request-Id must be at most {MAX_CLIENT_ID_CHARS} printable characters")
    return value
