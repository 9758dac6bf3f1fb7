"""Property tests over random traces and configs: budgets hold, blocks are never leaked or
double-owned, every request ends exactly once, cancelled requests never run again, and
prefix-cache hits never cross isolation keys."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, event, given, seed, settings
from hypothesis import strategies as st

from magnitude.engine.output import RunnerOutput, SampledToken
from magnitude.engine.request import Request, RequestStatus
from magnitude.engine.sampling import SamplingParams
from magnitude.engine.scheduler import Scheduler
from magnitude.policy.load import resolve_config
from magnitude.sim.cost import LinearCost

TERMINAL_EVENTS = {"finish", "cancel", "reject", "timeout"}


@st.composite
def configs(draw, pressure: bool = False):
    budget = draw(st.integers(4, 48))
    block = draw(st.sampled_from([1, 2, 4, 8]))
    sets = [
        f"scheduler.tokenBudget={budget}",
        f"scheduler.prefillChunkSize={draw(st.integers(1, budget))}",
        f"scheduler.maxSequences={draw(st.integers(6 if pressure else 1, 12))}",
        f"scheduler.preemptionMode={(mode := draw(st.sampled_from(['recompute', 'swap', 'auto'])))}",
        f"scheduler.agingSecondsPerLevel={draw(st.sampled_from(['null', '1', '5']))}",
        f"scheduler.tenantFairness={draw(st.booleans())}",
        f"scheduler.maxLookaheadTokens={draw(st.integers(0, 2))}",
        # With a target, the ITL bound runs and the step's attention load is checked against its plan.
        f"scheduler.itlTargetMs={draw(st.sampled_from(['null', '25', '60']))}",
        f"kvCache.blockSize={block}",
        f"kvCache.numBlocks={draw(st.integers(50 // block + 1, (64 if pressure else 100) // block))}",
        f"kvCache.swapBlocks={draw(st.integers(1 if mode == 'swap' else 0, 24))}",  # swap needs host space
        f"admission.maxQueuedRequests={64 if pressure else draw(st.sampled_from([3, 64]))}",
    ]
    if draw(st.booleans()):
        sets.append("scheduler.tenantQuotas=[{name: t0, maxRunningShare: 0.5, maxTokenShare: 0.5}]")
    return resolve_config(None, sets)


request_specs = st.lists(
    st.fixed_dictionaries(
        {
            "arrival": st.integers(0, 6),
            "prefix": st.integers(0, 2),  # shared prompt prefixes make cache hits likely
            "prompt": st.lists(st.integers(1, 4), min_size=1, max_size=24),
            "outputs": st.integers(1, 14),
            "tenant": st.sampled_from(["t0", "t1", "t2"]),
            "key": st.sampled_from(["rev1", "rev2"]),
            "cls": st.sampled_from(["interactive", "standard", "batch"]),
            "cancel": st.none() | st.integers(0, 12),  # steps after arrival
            "deadline": st.none() | st.integers(1, 30),
            "lookahead": st.integers(0, 2),
        }
    ),
    min_size=3,
    max_size=20,
)
PREFIXES = [[9] * 8, [8, 7] * 6, [5, 6, 5]]


def make(i: int, spec: dict) -> Request:
    prompt = (PREFIXES[spec["prefix"]] + spec["prompt"])[:40]
    return Request(
        f"r{i}", prompt, len(prompt), SamplingParams(max_tokens=spec["outputs"]), float(spec["arrival"]),
        priority_class=spec["cls"], tenant=spec["tenant"], deadline=None if spec["deadline"] is None
        else spec["arrival"] + float(spec["deadline"]), eos_token_ids=[3], cache_key=f"{spec['key']}|{spec['tenant']}",
        num_lookahead=spec["lookahead"],
    )


def check_sharing(s: Scheduler, reqs: dict[str, Request]) -> None:
    kv = s.kv
    owners: dict[int, set[str]] = {}
    for rid, table in kv.tables.items():
        req = reqs[rid]
        for i, b in enumerate(table):
            owners.setdefault(b, set()).add(req.cache_key)
            key = kv._block_key[b]
            if key is not None and i < req.num_computed_tokens // kv.block_size:
                # a registered block holds exactly this request's tokens, under its own isolation key
                assert key[1] == req.cache_key
                assert list(key[2]) == req.token_ids(i * kv.block_size, (i + 1) * kv.block_size)
    assert all(len(keys) == 1 for keys in owners.values()), "a block is shared across isolation keys"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), specs=request_specs, eos_every=st.integers(0, 9), fail_every=st.integers(0, 15))
def test_scheduler_invariants_hold_on_random_traces(config, specs, eos_every, fail_every) -> None:
    run_and_check(config, specs, eos_every, fail_every)


@pytest.mark.timeout(120, method="thread")  # a hang kills the run: a failure, not a stall
@seed(3)  # this seed (6 and 7 too) found an endless admit/preempt cycle between fair-share and victim order
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(config=configs(), specs=request_specs, eos_every=st.integers(0, 9), fail_every=st.integers(0, 15))
def test_no_admit_preempt_cycle_regression(config, specs, eos_every, fail_every) -> None:
    run_and_check(config, specs, eos_every, fail_every)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(pressure=True), specs=request_specs.map(lambda xs: [dict(x, deadline=None) for x in xs]))
def test_invariants_hold_under_memory_pressure(config, specs) -> None:
    """Many sequences, few blocks: preemption (recompute and swap) on most examples."""
    run_and_check(config, specs, eos_every=0, fail_every=0)


# auto's cost model: swapping a block out and back costs about what recomputing it does, so victims go both ways.
AUTO_COST = LinearCost(per_prefill_token=0.000035, per_swap_token=0.00001)


def run_and_check(config, specs, eos_every: int, fail_every: int) -> None:
    s = Scheduler(config, cost_model=AUTO_COST)
    sp = config.scheduler
    reqs = {f"r{i}": make(i, spec) for i, spec in enumerate(specs)}
    cancel_at = {f"r{i}": spec["arrival"] + spec["cancel"] for i, spec in enumerate(specs) if spec["cancel"] is not None}
    cancelled: set[str] = set()
    terminal_events: Counter[str] = Counter()
    t, n = 0, 0
    while t < 400:
        for rid, r in reqs.items():
            if r.arrival_time == t:
                s.add_request(r, float(t))
        for rid, at in cancel_at.items():
            if at == t and not reqs[rid].status.is_terminal:
                s.abort(rid, float(t))
                cancelled.add(rid)
        plan = s.schedule(float(t))
        scheduled = [q.request_id for q in plan.seqs]
        assert len(scheduled) == len(set(scheduled)) <= sp.max_sequences
        assert sum(q.num_tokens + q.num_lookahead for q in plan.seqs) <= sp.token_budget
        assert len(s.running) <= sp.max_sequences
        assert not cancelled & set(scheduled), "a cancelled request was scheduled"
        sampled = {}
        failed = {}
        for q in plan.seqs:
            n += 1
            if fail_every and n % fail_every == 0:
                failed[q.request_id] = "boom"
            elif q.sample:
                tok = 3 if eos_every and n % eos_every == 0 else 1 + n % 2
                sampled[q.request_id] = [SampledToken(tok)] + [SampledToken(1)] * (q.num_lookahead and n % 2)
        s.update_from_output(plan, RunnerOutput(sampled=sampled, failed=failed), float(t + 1))
        s.kv.check_invariants()
        check_sharing(s, reqs)
        for e in s.drain_events():
            if e.kind in TERMINAL_EVENTS:
                terminal_events[e.request_id] += 1
            if e.kind in ("preempt", "swap_in", "timeout", "reject"):
                event(f"saw {e.kind}")
        t += 1
        if t > 13 and not s.has_work():
            break
    assert not s.has_work(), "work left after 400 steps"
    for rid, r in reqs.items():
        assert r.status.is_terminal, f"{rid} ended {r.status}"
        assert terminal_events[rid] == 1, f"{rid}: {terminal_events[rid]} terminal events"
        if r.status is RequestStatus.FINISHED and r.finish_reason == "length":
            assert r.num_output_tokens == r.max_tokens
        assert len(r.token_times) == r.num_output_tokens
    assert s.kv.num_used == 0 and s.kv.usage().swap_used_blocks == 0
    if s.kv.prefix_hits:
        event("saw a prefix-cache hit")
