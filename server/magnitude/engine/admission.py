"""Admission: accept a request into the queue, or reject it now with a reason and a retry-after.

A bounded queue fails fast instead of queueing forever. Checks, in order: known priority class,
load shedding, length, KV capacity, deadline, then the queue bounds (requests, estimated
tokens, estimated wait from the measured drain rate). Bounds are fair: once the queue is more
than half full, one tenant may hold at most `maxTenantQueueShare` of it, so a heavy tenant
cannot get a quiet tenant's requests rejected; and the estimated wait counts only the work the
fair order would admit before this request (better levels, then its tenant's turn among the
tenants at its level: `RequestQueue.fair_work_ahead`), not the whole backlog, so a quiet tenant
behind a flooding one is not refused a wait it would not have. Pure function of its inputs: no
I/O, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from magnitude.engine.request import Request
from magnitude.policy.schema import AdmissionPolicy

MIN_RETRY_AFTER_S = 1.0


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    accepted: bool
    reason: str | None = None
    retry_after_s: float | None = None  # None: retrying the same request will not help


ACCEPT = AdmissionDecision(True)


@dataclass(frozen=True, slots=True)
class QueueView:
    """What admission may know about the queue and the engine."""

    queued_requests: int
    queued_tokens: int
    tenant_requests: int
    tenant_tokens: int
    known_classes: frozenset[str]
    shedding: frozenset[str]
    kv_capacity_tokens: int
    max_model_len: int | None
    drain_tokens_per_s: float | None  # measured service rate; None until observed
    min_request_seconds: float | None  # a lower bound on the request's own service time
    ahead_tokens: int | None = None  # queued work the fair order admits first; None: all of it


def _retry_after(excess_tokens: float, view: QueueView) -> float:
    if not view.drain_tokens_per_s:
        return MIN_RETRY_AFTER_S
    return max(MIN_RETRY_AFTER_S, math.ceil(excess_tokens / view.drain_tokens_per_s))


def check_admission(request: Request, view: QueueView, policy: AdmissionPolicy, now: float) -> AdmissionDecision:
    # The length and capacity checks take the cap (the request may use all of it); the queue
    # bounds take the expected work, as the queue's own figures do.
    work = request.num_prompt_tokens + request.max_tokens
    demand = request.remaining_work_tokens
    if request.priority_class not in view.known_classes:
        return AdmissionDecision(False, f"unknown_priority_class:{request.priority_class}")
    if request.priority_class in view.shedding:
        return AdmissionDecision(False, "shedding", _retry_after(view.queued_tokens, view))
    limit = view.max_model_len if policy.max_model_len is None else policy.max_model_len
    if limit is not None and work > limit:
        return AdmissionDecision(False, f"too_long:{work}>{limit}")
    if request.max_total_tokens > view.kv_capacity_tokens:
        return AdmissionDecision(False, f"exceeds_kv_capacity:{request.max_total_tokens}>{view.kv_capacity_tokens}")
    if request.deadline is not None:
        own = view.min_request_seconds or 0.0
        if now + own > request.deadline:
            return AdmissionDecision(False, "deadline_unreachable")

    if view.queued_requests + 1 > policy.max_queued_requests:
        avg = view.queued_tokens / max(1, view.queued_requests)
        return AdmissionDecision(False, "queue_full", _retry_after(avg, view))
    half_full = view.queued_requests * 2 >= policy.max_queued_requests
    if half_full and view.tenant_requests + 1 > policy.max_tenant_queue_share * policy.max_queued_requests:
        return AdmissionDecision(False, "tenant_queue_share", _retry_after(view.tenant_tokens, view))
    half_tokens = view.queued_tokens * 2 >= policy.max_queued_tokens
    if half_tokens and view.tenant_tokens + demand > policy.max_tenant_queue_share * policy.max_queued_tokens:
        return AdmissionDecision(False, "tenant_queue_share", _retry_after(view.tenant_tokens, view))
    if view.queued_tokens + demand > policy.max_queued_tokens:
        return AdmissionDecision(
            False, "queue_tokens_full", _retry_after(view.queued_tokens + demand - policy.max_queued_tokens, view)
        )
    if view.drain_tokens_per_s:
        ahead = view.queued_tokens if view.ahead_tokens is None else view.ahead_tokens
        wait = ahead / view.drain_tokens_per_s
        if wait > policy.max_queue_wait_seconds:
            return AdmissionDecision(
                False,
                "estimated_wait",
                max(MIN_RETRY_AFTER_S, math.ceil(wait - policy.max_queue_wait_seconds)),
            )
        if request.deadline is not None and now + wait + (view.min_request_seconds or 0.0) > request.deadline:
            return AdmissionDecision(False, "deadline_unreachable")
    return ACCEPT
