"""Regressions found in review: swap copies of one step must be executable in the runner's order
(all swap-outs, then all swap-ins), and deadlines must not count a capped output as certain."""

from __future__ import annotations

import random

from sched_helpers import fake_output, make_request, make_scheduler

from magnitude.engine.queue import COMPACT_SLACK


def test_swap_copies_in_runner_order_bring_back_each_requests_own_kv() -> None:
    """Model the KV contents as labels: the forward pass labels every block of a resident request
    (request, index); copies run as the runner runs them (all swap-outs, then all swap-ins). Every
    request swapped in must find its own labels back."""
    swaps_checked = 0
    for seed in range(120):
        rng = random.Random(seed)
        s = make_scheduler("scheduler.preemptionMode=swap", "scheduler.tokenBudget=32",
                           "scheduler.prefillChunkSize=8", "kvCache.blockSize=4", "kvCache.swapBlocks=12",
                           "kvCache.enablePrefixCaching=false", "scheduler.agingSecondsPerLevel=1", num_blocks=12)
        device: dict[int, tuple[str, int]] = {}
        host: dict[int, tuple[str, int] | None] = {}
        t, n = 0.0, 0
        for _ in range(150):
            if rng.random() < 0.4 and n < 40:
                s.add_request(make_request(f"r{n}", rng.randint(1, 20), rng.randint(1, 12), t,
                                           priority_class=rng.choice(["interactive", "batch"])), t)
                n += 1
            s.drain_events()
            plan = s.schedule(t)
            swapped_in = {e.request_id for e in s.drain_events() if e.kind == "swap_in"}
            for d, h in plan.swap_out:
                host[h] = device.get(d)
            for d, h in plan.swap_in:
                device[d] = host.get(h)
            starts = {q.request_id: q.start_position for q in plan.seqs}
            for rid in swapped_in & starts.keys():  # computed positions' blocks must come back intact
                table = s.kv.tables[rid]
                for i in range(-(-starts[rid] // 4)):
                    assert device[table[i]] == (rid, i), f"seed {seed}: {rid} block {i} came back with {device[table[i]]}"
                    swaps_checked += 1
            for q in plan.seqs:  # the forward pass writes the blocks of the positions it computes
                table = s.kv.tables[q.request_id]
                for i in range(q.start_position // 4, -(-(q.start_position + q.num_tokens) // 4)):
                    device[table[i]] = (q.request_id, i)
            s.update_from_output(plan, fake_output(plan), t + 1)
            t += 1
        s.kv.check_invariants()
    assert swaps_checked > 100, "the scenario must exercise swap-in"


def _warm_scheduler(step_seconds: float = 0.05):
    """A scheduler that has measured its step time (deadline estimates need one)."""
    s = make_scheduler(num_blocks=512)
    s.add_request(make_request("warm", 10, 3), 0.0)
    t = 0.0
    for _ in range(4):
        plan = s.schedule(t)
        out = fake_output(plan)
        out.duration_s = step_seconds
        t += step_seconds
        s.update_from_output(plan, out, t)
    return s, t


def test_deadline_counts_max_tokens_only_when_the_length_is_known() -> None:
    """max_tokens is a cap unless ignore_eos: a 5 s deadline with 256 possible tokens at 50 ms a step
    is reachable (EOS may come early), but not when all 256 tokens must be generated."""
    s, t = _warm_scheduler()
    capped = make_request("capped", 20, 256, t, deadline=t + 5.0)
    capped.sampling.ignore_eos = False
    assert s.add_request(capped, t).accepted
    exact = make_request("exact", 20, 256, t, deadline=t + 5.0)
    decision = s.add_request(exact, t)
    assert not decision.accepted and decision.reason == "deadline_unreachable"


def test_per_tenant_state_is_dropped_when_the_tenant_is_idle() -> None:
    """Tenant names come from clients (`user`, X-Tenant): 500 one-off tenants must not leave 500 entries."""
    s = make_scheduler(num_blocks=256)
    t = 0.0
    for i in range(500):
        s.add_request(make_request(f"r{i}", 4, 1, t, tenant=f"tenant-{i}"), t)
        plan = s.schedule(t)
        t += 1
        s.update_from_output(plan, fake_output(plan), t)
    s.schedule(t)
    assert not s.requests
    assert len(s._running_by_tenant) + len(s._last_service) + len(s._tenant_caps) == 0


def test_deadline_entries_of_finished_requests_are_compacted() -> None:
    s = make_scheduler("admission.maxQueuedRequests=5000", "admission.maxQueuedTokens=1000000", num_blocks=64)
    reqs = [make_request(f"r{i}", 4, 1, arrival=0.0, deadline=1000.0 + i) for i in range(1000)]
    for r in reqs:
        assert s.add_request(r, 0.0).accepted
    for r in reqs[:-1]:
        s.abort(r.request_id, 1.0)
    assert len(s._deadlines) <= 2 * 1 + COMPACT_SLACK  # one live deadline, not 1,000 entries until t=1000
    assert s.queue.num_entries <= 2 * 1 + COMPACT_SLACK


def test_a_reused_request_id_is_not_timed_out_by_its_predecessor_s_deadline() -> None:
    s = make_scheduler(num_blocks=64)
    s.add_request(make_request("x", 4, 1, arrival=0.0, deadline=5.0), 0.0)
    s.abort("x", 1.0)
    again = make_request("x", 4, 50, arrival=2.0, deadline=100.0)
    s.add_request(again, 2.0)
    s.schedule(6.0)
    assert not again.status.is_terminal, again.finish_reason
