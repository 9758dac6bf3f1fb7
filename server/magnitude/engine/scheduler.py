"""The scheduler: which tokens of which requests one step computes.

There is no prefill phase and no decode phase here (vLLM V1's framing). Each request has
`num_computed_tokens` and a target `num_tokens` (prompt + generated); a step hands out tokens
so computed counts catch up. One `schedule(now)`:

1. release what finished, was cancelled or timed out (blocks were already freed);
2. every resident request that has caught up gets one next-token slot (plus its lookahead
   draft slots), in stable order;
3. the remaining token budget goes to prefill chunks of at most `prefillChunkSize` tokens per
   request: resident partial prefills first (round-robin within a priority level), then
   swapped requests come back, then waiting requests are admitted by aged priority with
   tenant fair share and quotas. With an ITL target (`itlTargetMs`) and a cost model (handed in
   by the engine, measured at start-up, or by the simulator), a step
   that carries decodes also keeps its total predicted time within the target: prefill takes
   what the decodes leave;
4. when a block cannot be allocated, evictable cached blocks go first, then a victim is
   preempted (worst effective priority, then latest arrival) by recompute or swap; `auto`
   chooses per victim by cost: recomputing its computed tokens on the cost model's prefill curve
   against copying its blocks out and back at the cost model's swap rate (host space permitting),
   and logs both figures with the choice.

Every decision is a `SchedulerEvent` with a reason. The budgets are local countdowns checked
by asserts at the end of the step. Pure: the caller passes `now`; no torch, no I/O, not
thread-safe (call from the engine loop's thread only).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol

from magnitude.engine.admission import AdmissionDecision, QueueView, check_admission
from magnitude.engine.events import EventKind, SchedulerEvent
from magnitude.engine.kv_cache import KVCacheManager
from magnitude.engine.output import AttentionLoad, RequestUpdate, RunnerOutput, ScheduledSeq, StepPlan
from magnitude.engine.queue import COMPACT_SLACK, RequestQueue, queue_key
from magnitude.engine.request import Request, RequestStatus
from magnitude.engine.stats import SchedulerStats
from magnitude.policy.schema import STATIC_PREFILL_CHUNK, STATIC_TOKEN_BUDGET, EngineConfig

_EMA = 0.2
# Finished requests seen before their mean output length replaces admission.expectedOutputTokens.
MIN_OUTPUT_SAMPLES = 8
# Prefill tokens a step may carry when its decodes alone already miss the ITL target.
ITL_PREFILL_FLOOR = 16
_TERMINAL_EVENT: dict[RequestStatus, EventKind] = {
    RequestStatus.FINISHED: "finish",
    RequestStatus.CANCELLED: "cancel",
    RequestStatus.REJECTED: "reject",
    RequestStatus.TIMED_OUT: "timeout",
}


class StepCost(Protocol):
    """What `preemptionMode: auto` needs of a cost model (sim/cost.py's models satisfy it)."""

    def seconds_for(self, decodes: int, prefill_tokens: int, swapped_tokens: int = 0,
                    attention: AttentionLoad | None = None) -> float: ...


@dataclass(slots=True)
class _Step:
    """One step's countdowns and choices."""

    plan: StepPlan
    budget: int
    scheduled: dict[str, int] = field(default_factory=dict)  # request id -> tokens (without lookahead)
    lookahead: dict[str, int] = field(default_factory=dict)
    tenant_tokens: dict[str, int] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)  # ids preempted this step: not re-admitted in it
    swapped_in: set[str] = field(default_factory=set)
    cost_decodes: int = 0  # the step's shape for the ITL bound: one-token sampling chunks
    cost_prefill: int = 0  # and every other token (chunks, draft positions)
    attention: AttentionLoad = AttentionLoad()  # and what its sequences read and attend
    itl_floor_left: int = 0  # prefill tokens still allowed in a step whose decodes alone miss the target


class Scheduler:
    """Pure scheduling policy over a paged KV cache. See the module docstring for one step."""

    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int | None = None,
        num_swap_blocks: int | None = None,
        max_model_len: int | None = None,
        max_events: int = 100_000,
        cost_model: StepCost | None = None,
    ):
        sp = config.scheduler
        if sp.preemption_mode == "auto" and cost_model is None:
            raise ValueError("scheduler.preemptionMode auto compares recompute and swap on a cost model: pass cost_model")
        self.cost_model = cost_model
        self.config = config
        self.policy = sp
        # Null means "derive" (sim/cost.py derive_scheduler_limits, which the engine and the simulator
        # apply before building this); a bare Scheduler has no cost model and takes the static defaults.
        self.token_budget = sp.token_budget if sp.token_budget is not None else STATIC_TOKEN_BUDGET
        self.max_sequences = sp.max_sequences
        chunk = sp.prefill_chunk_size if sp.prefill_chunk_size is not None else STATIC_PREFILL_CHUNK
        self.chunk_size = min(chunk, self.token_budget)
        # itlTargetMs bounds each step's predicted time (decodes plus every chunk) on the cost model.
        if sp.itl_target_ms is not None and cost_model is None:
            raise ValueError("scheduler.itlTargetMs bounds each step on a cost model: pass cost_model "
                             "(the engine's calibration, the simulator's --cost-model)")
        self.itl_target_s = sp.itl_target_ms / 1000.0 if sp.itl_target_ms is not None else None
        # Speculation: a configured draft sets every eligible request's lookahead to
        # numSpeculativeTokens, which is also the bound when maxLookaheadTokens is left at 0.
        draft = config.draft_model
        self.num_speculative_tokens = draft.num_speculative_tokens if draft is not None else 0
        self.max_lookahead = sp.max_lookahead_tokens or self.num_speculative_tokens
        self.speculating = draft is None or draft.mode != "off"  # `auto` flips it (set_speculation)
        blocks = num_blocks if num_blocks is not None else config.kv_cache.num_blocks
        if blocks is None:
            raise ValueError("kvCache.numBlocks is null: pass num_blocks (sized by the runner)")
        swap = num_swap_blocks if num_swap_blocks is not None else config.kv_cache.swap_blocks
        self.kv = KVCacheManager(blocks, config.kv_cache.block_size, swap, config.kv_cache.enable_prefix_caching)
        self.block_size = config.kv_cache.block_size
        self.max_model_len = max_model_len
        self.queue = RequestQueue(sp.aging_seconds_per_level, sp.tenant_fairness)
        self._priority = {c.name: c.priority for c in sp.priority_classes}
        self._known_classes = frozenset(self._priority)
        self.requests: dict[str, Request] = {}  # every non-terminal request
        self.running: dict[str, Request] = {}  # resident, in stable (admission) order
        self.swapped: list[Request] = []
        self._running_by_tenant: dict[str, int] = {}
        self._last_service: dict[str, int] = {}
        self._tenant_caps: dict[str, tuple[int, int, float]] = {}
        self._deadlines: list[tuple[float, int, str]] = []  # ids: a finished request is not kept alive
        self._deadline_seq = itertools.count()
        self._num_deadlines = 0  # live requests with a deadline; dead heap entries are compacted
        self._to_release: list[str] = []
        self.events: deque[SchedulerEvent] = deque(maxlen=max_events)
        self.shedding: frozenset[str] = frozenset()
        self.step_id = 0
        self._step_seconds: float | None = None
        self._drain: float | None = None
        self._mean_output: float | None = None  # EMA of finished requests' output lengths
        self._outputs_seen = 0
        self._last_plan_time: float | None = None
        self._last_plan_saturated = False
        self._stats = SchedulerStats(0, 0, 0, 0, 0, blocks, 0, 0, swap, 0, False, None, None)

    # ------------------------------------------------------------------ requests in and out
    def _prepare(self, request: Request) -> None:
        if not request.priority_class:
            request.priority_class = self.policy.default_priority_class
        request.priority = self._priority.get(request.priority_class, 0)
        if not request.tenant:
            request.tenant = "default"
        if request.output_estimate is None:
            request.output_estimate = self.expected_output_tokens()
        # Penalties, logit_bias and grammars draft too (the runner verifies each position as a
        # plain step would see it): every request gets the lookahead.
        if self.num_speculative_tokens and not request.num_lookahead:
            request.num_lookahead = self.num_speculative_tokens

    def expected_output_tokens(self) -> int:
        """What admission counts for an output whose length is unknown: the measured mean output
        length once MIN_OUTPUT_SAMPLES requests have finished, else admission.expectedOutputTokens."""
        if self._mean_output is None or self._outputs_seen < MIN_OUTPUT_SAMPLES:
            return self.config.admission.expected_output_tokens
        return max(1, round(self._mean_output))

    def _min_service_seconds(self, request: Request) -> float | None:
        """A lower bound on the time to finish the request once it runs (None before any step)."""
        if self._step_seconds is None:
            return None
        steps = math.ceil(max(1, request.num_tokens - request.num_computed_tokens) / self.chunk_size)
        if request.sampling.ignore_eos:  # only then is the output length known; else max_tokens is a cap
            steps += max(0, request.max_tokens - request.num_output_tokens - 1)
        return steps * self._step_seconds

    def check_admission(self, request: Request, now: float) -> AdmissionDecision:
        self._prepare(request)
        t_req, t_tok = self.queue.tenant_figures(request.tenant)
        view = QueueView(
            queued_requests=self.queue.num_requests,
            queued_tokens=self.queue.num_tokens,
            tenant_requests=t_req,
            tenant_tokens=t_tok,
            known_classes=self._known_classes,
            shedding=self.shedding,
            kv_capacity_tokens=self.kv.num_blocks * self.block_size,
            max_model_len=self.max_model_len,
            drain_tokens_per_s=self._drain,
            min_request_seconds=self._min_service_seconds(request),
            ahead_tokens=self.queue.fair_work_ahead(request.tenant, request.priority, self._tenant_share),
        )
        return check_admission(request, view, self.config.admission, now)

    def add_request(self, request: Request, now: float) -> AdmissionDecision:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        decision = self.check_admission(request, now)
        if not decision.accepted:
            request.status = RequestStatus.REJECTED
            request.finish_time = now
            request.finish_reason = decision.reason
            self._count(self._stats.rejections, decision.reason or "rejected")
            self._count(self._stats.finished, RequestStatus.REJECTED.value)
            self._event(now, "reject", request.request_id, decision.reason or "rejected")
            return decision
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.queue.push(request)
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, next(self._deadline_seq), request.request_id))
            self._num_deadlines += 1
        return decision

    def abort(
        self,
        request_id: str,
        now: float,
        status: RequestStatus = RequestStatus.CANCELLED,
        reason: str = "client_disconnected",
    ) -> None:
        request = self.requests.get(request_id)
        if request is None or request.status.is_terminal:
            return
        self._terminate(request, status, reason, now)

    def finish_request(self, request_id: str, now: float, reason: str = "stop") -> None:
        self.abort(request_id, now, RequestStatus.FINISHED, reason)

    def set_shedding(self, classes: set[str] | frozenset[str]) -> None:
        self.shedding = frozenset(classes)

    def has_work(self) -> bool:
        return bool(self.running or self.queue.num_requests or self.swapped)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def queue_position(self, request_id: str) -> int | None:
        request = self.requests.get(request_id)
        return None if request is None else self.queue.position(request)

    def drain_events(self) -> list[SchedulerEvent]:
        events = list(self.events)
        self.events.clear()
        return events

    def _terminate(self, request: Request, status: RequestStatus, reason: str, now: float) -> None:
        """Leave the system now: blocks freed at once, released (reported) at the next step."""
        if request.status is RequestStatus.WAITING:
            self.queue.remove(request)
        elif request.status is RequestStatus.RUNNING:
            self.running.pop(request.request_id, None)
            self._running_by_tenant[request.tenant] -= 1
        elif request.status is RequestStatus.SWAPPED:
            self.swapped.remove(request)
        self.kv.free(request)
        request.status = status
        request.finish_time = now
        request.finish_reason = reason
        if self.requests.pop(request.request_id, None) is not None and request.deadline is not None:
            self._forget_deadline()
        self._to_release.append(request.request_id)
        if status is RequestStatus.FINISHED and not request.sampling.ignore_eos and request.num_output_tokens:
            n = request.num_output_tokens
            self._outputs_seen += 1
            self._mean_output = n if self._mean_output is None else (1 - _EMA) * self._mean_output + _EMA * n
        if status is RequestStatus.REJECTED:
            self._count(self._stats.rejections, reason)
        self._count(self._stats.finished, status.value)
        self._event(now, _TERMINAL_EVENT[status], request.request_id, reason)
        self._forget_idle_tenant(request.tenant)

    def _forget_idle_tenant(self, tenant: str) -> None:
        """Per-tenant state is keyed by a client-chosen name: drop it once the tenant has nothing
        running, swapped or queued, so it stays bounded by the live tenants."""
        if self._running_by_tenant.get(tenant, 0) or self.queue.tenant_figures(tenant)[0]:
            return
        if any(r.tenant == tenant for r in self.swapped):
            return
        self._running_by_tenant.pop(tenant, None)
        self._last_service.pop(tenant, None)
        self._tenant_caps.pop(tenant, None)

    # ------------------------------------------------------------------ one step
    def schedule(self, now: float) -> StepPlan:
        self.step_id += 1
        self._expire_deadlines(now)
        self.kv.begin_step()
        step = _Step(StepPlan(self.step_id, speculating=self.speculating), self.token_budget,
                     itl_floor_left=ITL_PREFILL_FLOOR)
        plan = step.plan
        plan.released, self._to_release = self._to_release, []
        for rid in plan.released:
            self._event(now, "release", rid, "blocks_freed")

        partials = self._schedule_decodes(step, now)
        # Resident partial prefills at least as urgent as the best waiting request go first;
        # the rest share what admission leaves.
        head = self.queue.peek(now, frozenset(), self._tenant_order) if self.queue.num_requests else None
        head_level = self.queue.level_of(head, now) if head is not None else math.inf
        partials.sort(key=lambda r: (self.queue.level_of(r, now), r.last_prefill_step, self._key(r)))
        split = next((i for i, r in enumerate(partials) if self.queue.level_of(r, now) > head_level), len(partials))
        self._schedule_partial_prefills(step, partials[:split], now)
        self._swap_in(step, now)
        if not step.plan.preempted:
            # After a preemption for memory this step, admitting more work would only thrash.
            self._admit_waiting(step, now)
        self._schedule_partial_prefills(step, partials[split:], now)

        self._build_seqs(step)
        self._check_step(step)
        self._last_plan_time = now
        self._last_plan_saturated = bool(self.queue.num_requests or self.swapped) or step.budget == 0
        return plan

    def _schedule_decodes(self, step: _Step, now: float) -> list[Request]:
        """One slot (plus lookahead) for every resident request that has caught up; returns the
        resident requests still behind (partial prefills, recompute catch-up)."""
        partials: list[Request] = []
        running = RequestStatus.RUNNING
        bs = self.block_size
        scheduled, tenant_tokens = step.scheduled, step.tenant_tokens
        for req in list(self.running.values()):
            if req.status is not running:
                continue  # preempted earlier in this loop
            computed = req.num_computed_tokens
            if req.num_prompt_tokens + len(req.output_token_ids) - computed > 1:
                partials.append(req)
                continue
            k = 0
            if self.max_lookahead and req.num_lookahead and self.speculating:
                k = max(0, min(req.num_lookahead, self.max_lookahead, req.max_tokens - req.num_output_tokens - 1))
            if step.budget < 1 + k:
                self._defer(req, "token_budget", now)
                break
            # Fast path: most decodes still have room in their last block.
            if len(req.block_ids) * bs < computed + 1 + k and not self._allocate(step, req, computed + 1 + k, now):
                continue  # the request itself was the victim
            rid = req.request_id
            scheduled[rid] = 1
            if k:
                step.lookahead[rid] = k
            step.budget -= 1 + k
            tenant_tokens[req.tenant] = tenant_tokens.get(req.tenant, 0) + 1 + k
            step.cost_decodes += 1
            step.cost_prefill += k
            step.attention = step.attention.plus_decode(computed, k)
        return partials

    def _itl_cap(self, step: _Step, start: int, num_tokens: int, n: int) -> int:
        """The largest m <= n tokens of a chunk starting at `start` (of `num_tokens`) that keeps the
        step's predicted time within the ITL target; n when no bound applies (no target, or no
        decode in the step: nobody is waiting for a next token)."""
        target = self.itl_target_s
        if target is None or step.cost_decodes == 0 or n <= 0:
            return n
        assert self.cost_model is not None
        cost, d, p, att = self.cost_model.seconds_for, step.cost_decodes, step.cost_prefill, step.attention

        def fits(m: int) -> bool:
            if m == 1 and start + 1 == num_tokens:  # a one-token sampling chunk is shaped as a decode
                return cost(d + 1, p, attention=att.plus_decode(start)) <= target
            return cost(d, p + m, attention=att.plus_chunk(start, m)) <= target

        if fits(n):
            return n
        lo = largest_fitting(fits, n - 1)
        if lo or cost(d, p, attention=att) <= target:
            return lo
        # The decodes alone already miss the target (a machine slower than the target): the step is
        # late whatever it carries, so prefill still gets ITL_PREFILL_FLOOR tokens, or admission would
        # wait for every running request to finish.
        m = min(n, step.itl_floor_left)
        step.itl_floor_left -= m
        return m

    def _schedule_partial_prefills(self, step: _Step, partials: list[Request], now: float) -> None:
        # Sorted by level, then least recently served: round-robin within a level.
        for req in partials:
            if step.budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING or req.request_id in step.scheduled:
                continue  # preempted, or preempted and re-admitted, earlier in this step
            n = min(self.chunk_size, req.num_tokens - req.num_computed_tokens, step.budget,
                    self._tenant_token_room(step, req.tenant))
            n = self._itl_cap(step, req.num_computed_tokens, req.num_tokens, n)
            if n <= 0:
                continue
            if not self._allocate(step, req, req.num_computed_tokens + n, now):
                continue
            self._take(step, req, n)

    def _swap_in(self, step: _Step, now: float) -> None:
        if not self.swapped:
            return
        self.swapped.sort(key=self._key)
        while self.swapped and len(self.running) < self.max_sequences and step.budget > 0:
            req = self.swapped[0]
            n = min(self.chunk_size, req.num_tokens - req.num_computed_tokens, step.budget)
            n = self._itl_cap(step, req.num_computed_tokens, req.num_tokens, n)
            if n <= 0:
                self._defer(req, "itl_target", now)
                return
            # Its host copy may hold blocks allocated for work it never ran; it needs them all back.
            need = max(self.kv.num_host_blocks(req), self.kv.blocks_for(req.num_computed_tokens + n))
            if need > self.kv.num_free_blocks:
                self._defer(req, "kv_blocks", now)
                return
            pairs = self.kv.swap_in(req)
            assert pairs is not None
            self.swapped.pop(0)
            step.plan.swap_in.extend(pairs)
            step.swapped_in.add(req.request_id)
            self._make_running(req)
            self._event(now, "swap_in", req.request_id, "blocks_available", blocks=len(pairs))
            ok = self._allocate(step, req, req.num_computed_tokens + n, now)
            assert ok, "swap-in checked its blocks"
            self._take(step, req, n)

    def _admit_waiting(self, step: _Step, now: float) -> None:
        excluded: set[str] = set()
        queue = self.queue
        while step.budget > 0 and len(self.running) < self.max_sequences:
            req = queue.peek(now, excluded, self._tenant_order)
            # A request preempted in this step waits for the next: tenant fair-share order can differ
            # from the victim order, and re-admitting a victim here would preempt it again, forever.
            if req is None or req.request_id in step.preempted:
                return
            tenant = req.tenant
            max_running, _, _ = self._caps(tenant)
            room = self._tenant_token_room(step, tenant)
            if self._running_by_tenant.get(tenant, 0) >= max_running or room <= 0:
                excluded.add(tenant)
                self._defer(req, "tenant_quota", now)
                continue
            if req.deadline is not None:
                est = self._min_service_seconds(req)
                if now >= req.deadline or (est is not None and now + est > req.deadline):
                    self._terminate(req, RequestStatus.REJECTED, "deadline_unreachable", now)
                    continue
            cached = self.kv.find_cached_prefix(req) if req.num_computed_tokens == 0 else []
            start = len(cached) * self.block_size
            n = min(self.chunk_size, req.num_tokens - start, step.budget, room)
            n = self._itl_cap(step, start, req.num_tokens, n)
            if n <= 0:
                self._defer(req, "itl_target", now)  # the decodes leave no room: admission waits, in order
                return
            # Keep one step of decode growth free, or the next step preempts what was just admitted.
            reserve = -(-len(self.running) // self.block_size)
            if not self.kv.can_allocate(req, start + n, cached, reserve) or not self.kv.allocate(req, start + n, cached):
                victim = self._victim()
                if victim is not None and self._key(victim) > self._key(req):
                    self._preempt(step, victim, "priority", now)
                    continue
                self._defer(req, "kv_blocks", now)
                return
            queue.pop(req)
            req.num_computed_tokens = start
            req.num_cached_tokens = start
            self._make_running(req)
            self._last_service[tenant] = self.step_id
            if req.admitted_time is None:
                req.admitted_time = now
                self._event(now, "admit", req.request_id, "scheduled", cached_tokens=start)
            else:
                self._event(now, "admit", req.request_id, "resumed", cached_tokens=start)
            self._take(step, req, n)
        head = queue.peek(now, excluded, self._tenant_order) if queue.num_requests else None
        if head is not None:
            self._defer(head, "token_budget" if step.budget <= 0 else "max_sequences", now)

    def _take(self, step: _Step, req: Request, n: int) -> None:
        assert req.request_id not in step.scheduled, f"{req.request_id} scheduled twice in one step"
        step.scheduled[req.request_id] = n
        step.budget -= n
        step.tenant_tokens[req.tenant] = step.tenant_tokens.get(req.tenant, 0) + n
        if n == 1 and req.num_computed_tokens + 1 == req.num_tokens:
            step.cost_decodes += 1
            step.attention = step.attention.plus_decode(req.num_computed_tokens)
        else:
            step.cost_prefill += n
            step.attention = step.attention.plus_chunk(req.num_computed_tokens, n)
        req.last_prefill_step = self.step_id
        req.last_defer_reason = None

    def _make_running(self, req: Request) -> None:
        req.status = RequestStatus.RUNNING
        self.running[req.request_id] = req
        self._running_by_tenant[req.tenant] = self._running_by_tenant.get(req.tenant, 0) + 1

    # ------------------------------------------------------------------ memory pressure
    def _allocate(self, step: _Step, req: Request, num_tokens: int, now: float) -> bool:
        """Blocks for `num_tokens` positions of a resident request, preempting victims as needed;
        False if `req` itself had to go."""
        while not self.kv.allocate(req, num_tokens):
            victim = self._victim()
            assert victim is not None
            self._preempt(step, victim, "kv_blocks", now)
            if victim is req:
                return False
        return True

    def _victim(self) -> Request | None:
        """Worst effective priority, then latest arrival (the largest queue key)."""
        if not self.running:
            return None
        # reversed: among equal keys the most recently admitted goes first
        return max(reversed(self.running.values()), key=self._key)

    def _preempt(self, step: _Step, req: Request, reason: str, now: float) -> None:
        rid = req.request_id
        n = step.scheduled.pop(rid, None)
        if n is not None:  # refund what it was given this step
            k = step.lookahead.pop(rid, 0)
            step.budget += n + k
            step.tenant_tokens[req.tenant] -= n + k
            if n == 1 and req.num_computed_tokens + 1 == req.num_tokens:
                step.cost_decodes -= 1
                step.cost_prefill -= k
                step.attention = step.attention.minus(AttentionLoad().plus_decode(req.num_computed_tokens, k))
            else:
                step.cost_prefill -= n + k
                step.attention = step.attention.minus(AttentionLoad().plus_chunk(req.num_computed_tokens, n))
        del self.running[rid]
        self._running_by_tenant[req.tenant] -= 1
        req.num_preemptions += 1
        mode = self.policy.preemption_mode
        figures: dict[str, object] = {}
        if mode == "auto":
            mode, figures = self._preemption_by_cost(req)
        if rid in step.swapped_in:
            # Its swap-in copy has not run yet, so its device blocks hold nothing to swap out: cancel the
            # copy and recompute (the runner copies out before in; swapping out would save garbage).
            mode, reason = "recompute", f"{reason}+swapped_in_this_step"
            targets = set(req.block_ids)
            step.plan.swap_in = [p for p in step.plan.swap_in if p[0] not in targets]
            step.swapped_in.discard(rid)
        if mode == "swap":
            pairs = self.kv.swap_out(req)
            if pairs is not None:
                req.status = RequestStatus.SWAPPED
                self.swapped.append(req)
                step.plan.swap_out.extend(pairs)
                self._record_preempt(step, req, "swap", reason, now, figures)
                self._event(now, "swap_out", rid, reason, blocks=len(pairs))
                return
            mode, reason = "recompute", f"{reason}+swap_space_full"
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.queue.push(req)
        self._record_preempt(step, req, mode, reason, now, figures)

    def _preemption_by_cost(self, req: Request) -> tuple[str, dict[str, object]]:
        """`auto`: recompute or swap, whichever the cost model says is cheaper for this victim.
        Recompute re-runs its computed tokens as prefill (`_recompute_seconds`); swap copies its
        blocks to the host and back. No host room for its blocks: recompute."""
        assert self.cost_model is not None
        computed = req.num_computed_tokens
        blocks = len(req.block_ids)
        cost = self.cost_model
        recompute_s = self._recompute_seconds(computed)
        swap_s = max(0.0, cost.seconds_for(0, 0, 2 * blocks * self.block_size) - cost.seconds_for(0, 0))
        if blocks > self.kv.num_free_host_blocks:
            choice, why = "recompute", "swap_space_full"
        else:
            choice, why = ("swap", "swap_cheaper") if swap_s < recompute_s else ("recompute", "recompute_cheaper")
        return choice, {"auto": why, "recompute_s": round(recompute_s, 6), "swap_s": round(swap_s, 6),
                        "computed_tokens": computed, "blocks": blocks}

    def _recompute_seconds(self, computed: int) -> float:
        """What re-running `computed` tokens costs as this scheduler would run them: chunks of
        `chunk_size`, each the curve's rise above an empty step, and each reading the positions
        before it. A cost model that measures attention charges that reading, which grows with the
        square of the length: a long victim is dearer to recompute than its token count says."""
        cost = self.cost_model
        assert cost is not None
        empty = cost.seconds_for(0, 0)

        def chunk(start: int, n: int) -> float:
            return max(0.0, cost.seconds_for(0, n, attention=AttentionLoad().plus_chunk(start, n)) - empty)

        size = self.chunk_size
        full, rest = divmod(computed, size)
        total = chunk(full * size, rest) if rest else 0.0
        if full:
            # The cost models charge attention linearly in the context read and the pairs, both
            # linear in a chunk's start: the full chunks sum in closed form (a victim of 100k
            # tokens in 16-token chunks would otherwise cost thousands of calls in one step).
            first = chunk(0, size)
            growth = chunk(size, size) - first if full > 1 else 0.0
            total += full * first + growth * full * (full - 1) / 2
        return total

    def _record_preempt(self, step: _Step, req: Request, mode: str, reason: str, now: float,
                        figures: dict[str, object] | None = None) -> None:
        step.plan.preempted.append((req.request_id, mode, reason))
        step.preempted.add(req.request_id)
        self._count(self._stats.preemptions, (mode, reason))
        self._event(now, "preempt", req.request_id, reason, mode=mode, **(figures or {}))

    def _deadline_live(self, entry: tuple[float, int, str]) -> bool:
        """The entry's request is still here, and it is the one that pushed it: an id a client
        reuses after its first request ended must not inherit that request's deadline."""
        req = self.requests.get(entry[2])
        return req is not None and req.deadline == entry[0] and not req.status.is_terminal

    def _forget_deadline(self) -> None:
        """A request with a deadline left: rebuild the heap once dead entries outnumber live ones
        (plus COMPACT_SLACK), instead of keeping them until their deadlines pass."""
        self._num_deadlines -= 1
        if len(self._deadlines) > 2 * self._num_deadlines + COMPACT_SLACK:
            self._deadlines = [e for e in self._deadlines if self._deadline_live(e)]
            heapq.heapify(self._deadlines)

    def _expire_deadlines(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            entry = heapq.heappop(self._deadlines)
            if self._deadline_live(entry):
                self._terminate(self.requests[entry[2]], RequestStatus.TIMED_OUT, "deadline", now)

    # ------------------------------------------------------------------ ordering and quotas
    def _key(self, req: Request) -> tuple[float, float, int]:
        return queue_key(req.priority, req.arrival_time, 0, self.queue.aging_seconds)

    def _caps(self, tenant: str) -> tuple[int, int, float]:
        caps = self._tenant_caps.get(tenant)
        if caps is None:
            q = self.policy.quota_of(tenant)
            caps = (
                max(1, math.floor(q.max_running_share * self.max_sequences)),
                max(1, math.floor(q.max_token_share * self.token_budget)),
                q.weight,
            )
            self._tenant_caps[tenant] = caps
        return caps

    def _tenant_token_room(self, step: _Step, tenant: str) -> int:
        return self._caps(tenant)[1] - step.tenant_tokens.get(tenant, 0)

    def _tenant_share(self, tenant: str) -> tuple[int, float]:
        """(running sequences, fair-share weight): what `_tenant_order` ranks tenants by. Admission
        asks this of tenants that may be rejected: their caps are not cached (client-chosen names)."""
        caps = self._tenant_caps.get(tenant)
        weight = caps[2] if caps is not None else self.policy.quota_of(tenant).weight
        return self._running_by_tenant.get(tenant, 0), weight

    def _tenant_order(self, tenant: str) -> tuple[float, int]:
        return (
            self._running_by_tenant.get(tenant, 0) / self._caps(tenant)[2],
            self._last_service.get(tenant, -1),
        )

    # ------------------------------------------------------------------ plan and invariants
    def _build_seqs(self, step: _Step) -> None:
        decodes: list[ScheduledSeq] = []
        chunks: list[ScheduledSeq] = []
        running = self.running
        for rid, n in step.scheduled.items():
            req = running[rid]
            start = req.num_computed_tokens
            end = start + n
            sample = end == req.num_tokens
            seq = ScheduledSeq(
                rid,
                req.token_ids(start, end),
                start,
                req.block_ids,
                sample,
                req.sampling,
                len(req.output_token_ids),
                step.lookahead.get(rid, 0),
                req.prompt_token_ids or [],
                req.output_token_ids,
            )
            (decodes if sample and n == 1 else chunks).append(seq)
        decodes.extend(chunks)
        step.plan.seqs = decodes

    def _check_step(self, step: _Step) -> None:
        total = sum(step.scheduled.values()) + sum(step.lookahead.values())
        assert step.budget >= 0 and total == self.token_budget - step.budget, "token budget countdown drifted"
        assert total <= self.token_budget, "token budget exceeded"
        assert len(self.running) <= self.max_sequences, "sequence budget exceeded"
        assert self.kv.num_used <= self.kv.num_blocks, "block budget exceeded"
        if self.itl_target_s is not None:  # what the ITL bound predicted is what the plan does
            assert step.attention == step.plan.attention_load(), "attention load countdown drifted"
        bs = self.block_size
        for rid, n in step.scheduled.items():
            req = self.running[rid]
            assert req.status is RequestStatus.RUNNING
            need = req.num_computed_tokens + n + step.lookahead.get(rid, 0)
            assert len(req.block_ids) * bs >= need, f"{rid}: block table too short"

    def set_limits(self, token_budget: int, chunk_size: int, itl_target_ms: float | None,
                   cost_model: StepCost | None) -> None:
        """Run the next steps with these limits and bound them on `cost_model` (the engine's derived
        limits, derived again from served step times). Requests in flight keep their state: a
        smaller budget or chunk only shapes the steps still to come."""
        if token_budget < 1 or chunk_size < 1:
            raise ValueError(f"token budget and chunk must be at least 1, got {token_budget} and {chunk_size}")
        if itl_target_ms is not None and cost_model is None:
            raise ValueError("scheduler.itlTargetMs bounds each step on a cost model: pass cost_model")
        if self.config.scheduler.preemption_mode == "auto" and cost_model is None:
            raise ValueError("scheduler.preemptionMode auto compares recompute and swap on a cost model: pass cost_model")
        self.token_budget = token_budget
        self.chunk_size = min(chunk_size, token_budget)
        self.itl_target_s = itl_target_ms / 1000.0 if itl_target_ms is not None else None
        self.cost_model = cost_model
        self._tenant_caps.clear()  # token shares are of the budget

    def set_speculation(self, on: bool) -> None:
        """Turn draft lookahead on or off for the next steps (the `auto` policy's decision)."""
        self.speculating = on

    # ------------------------------------------------------------------ results
    def update_from_output(self, plan: StepPlan, output: RunnerOutput, now: float) -> list[RequestUpdate]:
        updates: list[RequestUpdate] = []
        computed = 0
        stats = self._stats
        for seq in plan.seqs:
            rid = seq.request_id
            req = self.requests.get(rid)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            error = output.failed.get(rid)
            if error is None and seq.sample and not output.sampled.get(rid):
                error = "runner returned no token"
            if error is not None:
                self._terminate(req, RequestStatus.FINISHED, f"error: {error}", now)
                updates.append(RequestUpdate(rid, [], True, req.status, req.finish_reason))
                continue
            req.num_computed_tokens += seq.num_tokens
            computed += seq.num_tokens
            if req.num_output_tokens == 0:
                stats.prompt_tokens_total += seq.num_tokens
            new: list[int] = []
            reason: str | None = None
            if seq.sample:
                sampled = output.sampled[rid]
                req.num_computed_tokens += len(sampled) - 1  # accepted draft tokens were computed too
                drafts = output.num_drafts.get(rid, 0)
                if drafts:
                    req.spec_proposed += drafts
                    req.spec_accepted += len(sampled) - 1
                reason = self._append_tokens(req, sampled, new, now)
            self.kv.cache_full_blocks(req)
            if reason is not None:
                self._terminate(req, RequestStatus.FINISHED, reason, now)
            if seq.sample or reason is not None:
                updates.append(RequestUpdate(rid, new, reason is not None, req.status, reason))
        self._observe(plan, output, computed, now)
        return updates

    def _append_tokens(self, req: Request, sampled: list, new: list[int], now: float) -> str | None:
        sp = req.sampling
        stop_ids = sp.stop_token_ids
        eos = req.eos_token_ids if not sp.ignore_eos else ()
        for tok in sampled:
            token_id = tok.token_id
            if (eos and token_id in eos) or (stop_ids and token_id in stop_ids):
                return "stop"
            req.output_token_ids.append(token_id)
            req.token_times.append(now)
            if req.first_token_time is None:
                req.first_token_time = now
            new.append(token_id)
            self._stats.generation_tokens_total += 1
            if len(req.output_token_ids) >= req.max_tokens:
                return "length"
        return None

    def _observe(self, plan: StepPlan, output: RunnerOutput, computed: int, now: float) -> None:
        """Step time and drain rate estimates for admission and deadlines."""
        if self._last_plan_time is None or not plan.seqs:
            return
        d = output.duration_s if output.duration_s > 0 else now - self._last_plan_time
        if d <= 0:
            return
        self._step_seconds = d if self._step_seconds is None else (1 - _EMA) * self._step_seconds + _EMA * d
        if self._last_plan_saturated:
            rate = computed / d
            self._drain = rate if self._drain is None else (1 - _EMA) * self._drain + _EMA * rate

    # ------------------------------------------------------------------ figures
    def stats(self) -> SchedulerStats:
        s = self._stats
        u = self.kv.usage()
        s.step_id = self.step_id
        s.running = len(self.running)
        s.waiting = self.queue.num_requests
        s.swapped = len(self.swapped)
        s.kv_used_blocks = u.used_blocks
        s.kv_total_blocks = u.total_blocks
        s.kv_cached_free_blocks = u.cached_free_blocks
        s.swap_used_blocks = u.swap_used_blocks
        s.swap_total_blocks = u.swap_total_blocks
        s.queued_tokens = self.queue.num_tokens
        s.shedding = bool(self.shedding)
        s.drain_tokens_per_s = self._drain
        s.step_seconds = self._step_seconds
        s.prefix_cache_queries = self.kv.prefix_queries
        s.prefix_cache_hits = self.kv.prefix_hits
        s.kv_alloc_failures = self.kv.alloc_failures
        # A snapshot: callers may keep it and compare it with the next one.
        return replace(s, preemptions=dict(s.preemptions), rejections=dict(s.rejections), finished=dict(s.finished))

    def _defer(self, req: Request, reason: str, now: float) -> None:
        # One event per change of reason, not one per step: a long queue stays cheap.
        if req.last_defer_reason != reason:
            req.last_defer_reason = reason
            self._event(now, "defer", req.request_id, reason)

    def _event(self, now: float, kind: EventKind, rid: str, reason: str, **detail: object) -> None:
        self.events.append(SchedulerEvent(now, kind, rid, reason, detail))

    @staticmethod
    def _count(counter: dict, key: object) -> None:
        counter[key] = counter.get(key, 0) + 1


def largest_fitting(fits: Callable[[int], bool], hi: int) -> int:
    """The largest n in [1, hi] with fits(n), 0 if none (binary search: cost grows with tokens)."""
    if hi < 1 or not fits(1):
        return 0
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
