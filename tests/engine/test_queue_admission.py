"""Queue ordering (priority, aging in the key, tenant fairness within a level) and admission bounds."""

from __future__ import annotations

import pytest
from sched_helpers import fake_output, make_request, make_scheduler

from magnitude.engine.admission import QueueView, check_admission
from magnitude.engine.output import RunnerOutput, SampledToken
from magnitude.engine.queue import COMPACT_SLACK, RequestQueue
from magnitude.policy.schema import AdmissionPolicy


def queued(q: RequestQueue, rid: str, priority: int, arrival: float, tenant: str = "t"):
    r = make_request(rid, 4, 1, arrival=arrival, tenant=tenant)
    r.priority = priority
    q.push(r)
    return r


def drain(q: RequestQueue, now: float, order=None) -> list[str]:
    out = []
    while (r := q.peek(now, tenant_order=order)) is not None:
        q.pop(r)
        out.append(r.request_id)
    return out


def test_priority_then_arrival_without_aging() -> None:
    q = RequestQueue(aging_seconds=None)
    queued(q, "batch-old", 2, 0.0)
    queued(q, "std", 1, 5.0)
    queued(q, "int", 0, 9.0)
    assert drain(q, now=100.0) == ["int", "std", "batch-old"]


def test_aging_moves_an_old_request_up_a_level() -> None:
    q = RequestQueue(aging_seconds=10.0)
    queued(q, "batch-old", 2, 0.0)  # key 20
    queued(q, "std-new", 1, 15.0)  # key 25
    queued(q, "int-new", 0, 21.0)  # key 21
    assert drain(q, now=30.0) == ["batch-old", "int-new", "std-new"]


def test_fairness_among_tenants_at_the_same_level() -> None:
    q = RequestQueue(aging_seconds=10.0, fairness=True)
    for i in range(4):
        queued(q, f"heavy-{i}", 1, 0.1 * i, tenant="heavy")
    queued(q, "quiet-0", 1, 0.35, tenant="quiet")
    running = {"heavy": 3, "quiet": 0}
    # The quiet tenant holds nothing: it goes first although it arrived last (same level).
    assert q.peek(1.0, tenant_order=lambda t: (running[t], 0)).request_id == "quiet-0"
    # Without fairness, plain key order.
    q2 = RequestQueue(aging_seconds=10.0, fairness=False)
    for i in range(2):
        queued(q2, f"heavy-{i}", 1, 0.1 * i, tenant="heavy")
    queued(q2, "quiet-0", 1, 0.35, tenant="quiet")
    assert q2.peek(1.0, tenant_order=lambda t: (running[t], 0)).request_id == "heavy-0"


def test_fairness_does_not_cross_levels() -> None:
    q = RequestQueue(aging_seconds=10.0)
    queued(q, "heavy-int", 0, 0.0, tenant="heavy")
    queued(q, "quiet-batch", 2, 0.0, tenant="quiet")
    assert q.peek(1.0, tenant_order=lambda t: (0 if t == "quiet" else 9, 0)).request_id == "heavy-int"


def test_fair_work_ahead_counts_better_levels_and_the_tenants_turn() -> None:
    q = RequestQueue(aging_seconds=None)
    for i in range(10):
        queued(q, f"noisy-{i}", 1, float(i), tenant="noisy")  # 4 tokens each (prompt 4, output 1)
    queued(q, "urgent", 0, 0.0, tenant="other")
    queued(q, "worse", 2, 0.0, tenant="other")
    running = {"noisy": 5, "quiet": 0}
    share = lambda t: (running.get(t, 0), 1.0)  # noqa: E731
    # The quiet tenant runs nothing: only the better level is ahead of it, not the noisy backlog.
    assert q.fair_work_ahead("quiet", 1, share) == 4
    # The noisy tenant's next request waits behind its own ten and the better level.
    assert q.fair_work_ahead("noisy", 1, share) == 44
    # With the quiet tenant at 7 running, noisy gets two turns (5 -> 7) first.
    running["quiet"] = 7
    assert q.fair_work_ahead("quiet", 1, share) == 4 + 2 * 4
    # A weight of 2 for noisy doubles its turns: 7 running per weight 1 is 14 for weight 2 (5 -> 14).
    assert q.fair_work_ahead("quiet", 1, lambda t: (running.get(t, 0), 2.0 if t == "noisy" else 1.0)) == 4 + 9 * 4
    # Without fairness the whole level goes first.
    q.fairness = False
    assert q.fair_work_ahead("quiet", 1, share) == 44
    for r in list(q):
        q.remove(r)
    assert q.fair_work_ahead("quiet", 1, share) == 0


def test_estimated_wait_reads_the_fair_work_ahead() -> None:
    r = make_request("r", 4, 100)
    r.priority_class = "standard"
    policy = AdmissionPolicy.model_validate({"maxQueueWaitSeconds": 30})
    backlog = view(queued_tokens=400, drain_tokens_per_s=10.0)
    assert check_admission(r, backlog, policy, 0.0).reason == "estimated_wait"
    assert check_admission(r, view(queued_tokens=400, drain_tokens_per_s=10.0, ahead_tokens=20), policy, 0.0).accepted


def test_removed_requests_leave_the_counts_at_once() -> None:
    q = RequestQueue(aging_seconds=None)
    a = queued(q, "a", 1, 0.0)
    queued(q, "b", 1, 1.0)
    q.remove(a)
    a.status = a.status.CANCELLED
    assert len(q) == 1 and q.num_tokens == 4 and drain(q, 0.0) == ["b"]


def view(**kw) -> QueueView:
    base = dict(queued_requests=0, queued_tokens=0, tenant_requests=0, tenant_tokens=0,
                known_classes=frozenset({"standard"}), shedding=frozenset(), kv_capacity_tokens=10_000,
                max_model_len=None, drain_tokens_per_s=None, min_request_seconds=None)
    base.update(kw)
    return QueueView(**base)


@pytest.mark.parametrize(
    ("kw", "policy", "reason", "retry"),
    [
        ({"known_classes": frozenset({"gold"})}, {}, "unknown_priority_class:standard", False),
        ({"shedding": frozenset({"standard"})}, {}, "shedding", True),
        ({"max_model_len": 50}, {}, "too_long:104>50", False),
        ({"kv_capacity_tokens": 64}, {}, "exceeds_kv_capacity:103>64", False),
        ({"queued_requests": 4}, {"maxQueuedRequests": 4}, "queue_full", True),
        ({"queued_requests": 3, "tenant_requests": 2}, {"maxQueuedRequests": 4}, "tenant_queue_share", True),
        ({"queued_tokens": 950}, {"maxQueuedTokens": 1000}, "queue_tokens_full", True),
        ({"queued_tokens": 400, "drain_tokens_per_s": 10.0}, {"maxQueueWaitSeconds": 30}, "estimated_wait", True),
    ],
)
def test_admission_rejects_with_reason(kw, policy, reason, retry) -> None:
    r = make_request("r", 4, 100)
    r.priority_class = "standard"
    d = check_admission(r, view(**kw), AdmissionPolicy.model_validate(policy), now=0.0)
    assert (d.accepted, d.reason) == (False, reason)
    assert (d.retry_after_s is not None) == retry
    if retry:
        assert d.retry_after_s >= 1.0


def test_quiet_tenant_is_admitted_while_heavy_tenant_is_capped() -> None:
    policy = AdmissionPolicy.model_validate({"maxQueuedRequests": 10, "maxTenantQueueShare": 0.5})
    r = make_request("r", 4, 4)
    r.priority_class = "standard"
    heavy = check_admission(r, view(queued_requests=6, tenant_requests=5), policy, 0.0)
    quiet = check_admission(r, view(queued_requests=6, tenant_requests=1), policy, 0.0)
    assert heavy.reason == "tenant_queue_share" and quiet.accepted


def test_retry_after_follows_the_measured_drain_rate() -> None:
    s = make_scheduler("admission.maxQueuedRequests=2", "admission.maxTenantQueueShare=1", "scheduler.tokenBudget=8",
                       "kvCache.numBlocks=64",
                       "kvCache.blockSize=4")
    t = 0.0
    for i in range(2):
        s.add_request(make_request(f"r{i}", 40, 40), t)
    for _ in range(3):  # observe a few saturated steps lasting 0.5 s
        plan = s.schedule(t)
        t += 0.5
        s.update_from_output(plan, fake_output(plan), t)
    s.add_request(make_request("fill", 40, 40), t)
    d = s.add_request(make_request("late", 40, 40), t)
    assert d.reason == "queue_full"
    assert d.retry_after_s is not None and d.retry_after_s >= 1.0
    assert s.stats().drain_tokens_per_s == pytest.approx(16.0)


def test_cancelled_waiting_requests_leave_the_tenant_heap_without_reaching_its_head() -> None:
    # The head stays queued, so lazy deletion at the head never reaches the 1,000 behind it: their
    # entries (and prompt ids) must still be compacted away.
    q = RequestQueue(aging_seconds=None)
    queued(q, "head", 0, 0.0)
    behind = [queued(q, f"r{i}", 1, 1.0 + i) for i in range(1000)]
    for r in behind:
        q.remove(r)
        r.status = r.status.CANCELLED
    assert len(q) == 1
    assert q.num_entries <= 2 * len(q) + COMPACT_SLACK
    assert drain(q, 0.0) == ["head"]


def test_compaction_keeps_the_order_of_the_live_requests() -> None:
    q = RequestQueue(aging_seconds=None)
    reqs = [queued(q, f"r{i}", i % 3, float(i), tenant=f"t{i % 2}") for i in range(400)]
    for r in reqs[::3] + reqs[1::3]:
        q.remove(r)
        r.status = r.status.CANCELLED
    assert q.num_entries <= 2 * len(q) + COMPACT_SLACK
    live = reqs[2::3]
    assert drain(q, 0.0) == [r.request_id for r in sorted(live, key=lambda r: (r.priority, r.arrival_time))]


def uncapped(rid: str, prompt: int, cap: int, estimate: int | None) -> "object":
    """A request whose max_tokens is only a cap (no ignore_eos), as one without max_tokens is."""
    from magnitude.engine.request import Request
    from magnitude.engine.sampling import SamplingParams

    r = Request(rid, None, prompt, SamplingParams(max_tokens=cap), 0.0, priority_class="standard")
    r.output_estimate = estimate
    return r


def test_queue_bounds_count_the_expected_output_not_the_cap() -> None:
    """A request without max_tokens may run to the end of an 8k context; counted at its cap it
    would fill the token queue by itself. Counted at the expected output it is admitted, while
    the length and capacity checks still take the cap."""
    policy = AdmissionPolicy.model_validate({"maxQueuedTokens": 4000})
    r = uncapped("r", 100, 8000, estimate=200)
    assert r.remaining_work_tokens == 100 + 200 - 1
    assert check_admission(r, view(queued_tokens=1000), policy, 0.0).accepted
    r.output_estimate = None  # no estimate: the cap, as before
    assert check_admission(r, view(queued_tokens=1000), policy, 0.0).reason == "queue_tokens_full"
    r.output_estimate = 200
    assert check_admission(r, view(kv_capacity_tokens=4096), policy, 0.0).reason == "exceeds_kv_capacity:8099>4096"


def test_the_estimate_never_undercounts_what_is_already_generated() -> None:
    r = uncapped("r", 10, 500, estimate=20)
    r.output_token_ids = [1] * 30
    assert r.expected_output_tokens == 31
    r.sampling.ignore_eos = True  # the length is known: the cap is the output
    assert r.expected_output_tokens == 500


def test_the_scheduler_learns_the_mean_output_length() -> None:
    s = make_scheduler("admission.expectedOutputTokens=300", "kvCache.numBlocks=256")
    first = uncapped("first", 8, 1000, estimate=None)
    s.add_request(first, 0.0)
    assert first.output_estimate == 300  # nothing measured yet: the configured figure
    s.abort("first", 0.0)
    t = 0.0
    for i in range(12):  # twelve requests that each end by EOS (token 9) after 5 tokens
        r = uncapped(f"r{i}", 8, 1000, estimate=None)
        r.eos_token_ids = [9]
        s.add_request(r, t)
    while s.requests:
        plan = s.schedule(t)
        out = RunnerOutput(sampled={
            q.request_id: [SampledToken(9 if s.requests[q.request_id].num_output_tokens >= 5 else 1)]
            for q in plan.seqs if q.sample})
        s.update_from_output(plan, out, t)
        t += 0.1
    late = uncapped("late", 8, 1000, estimate=None)
    s.add_request(late, t)
    assert late.output_estimate == 5
