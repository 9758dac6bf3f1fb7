"""Scheduler behaviours one at a time: cancel, timeouts, swap and its fallback, quotas, lookahead,
stop conditions, runner failures, events."""

from __future__ import annotations

import pytest

from sched_helpers import fake_output, make_request, make_scheduler, shape

from magnitude.engine.output import RunnerOutput, SampledToken
from magnitude.engine.request import RequestStatus
from magnitude.engine.sampling import SamplingParams
from magnitude.engine.scheduler import Scheduler
from magnitude.policy.load import ConfigError, resolve_config
from magnitude.sim.cost import LinearCost, TableCost


def step(s, t: float, dt: float = 1.0, token: int = 7):
    plan = s.schedule(t)
    updates = s.update_from_output(plan, fake_output(plan, token), t + dt)
    return plan, updates


def test_abort_frees_blocks_at_once_and_is_never_scheduled_again() -> None:
    s = make_scheduler("scheduler.tokenBudget=64", "kvCache.blockSize=4", "kvCache.numBlocks=32")
    a, b = make_request("a", 20, 50), make_request("b", 20, 50)
    s.add_request(a, 0)
    s.add_request(b, 0)
    step(s, 0)
    used = s.kv.num_used
    s.abort("a", 1.0)
    assert a.status is RequestStatus.CANCELLED and a.finish_reason == "client_disconnected"
    assert s.kv.num_used == used - 5 and a.block_ids == []
    s.abort("a", 1.5)  # idempotent
    s.abort("nope", 1.5)  # unknown: no-op
    plan, _ = step(s, 1.0)
    assert plan.released == ["a"]
    assert "a" not in [q.request_id for q in plan.seqs]
    kinds = [(e.kind, e.request_id) for e in s.drain_events()]
    assert ("cancel", "a") in kinds and ("release", "a") in kinds
    s.kv.check_invariants()


def test_cancel_while_waiting_leaves_the_queue() -> None:
    s = make_scheduler("scheduler.tokenBudget=8", "scheduler.prefillChunkSize=8", "kvCache.numBlocks=64")
    s.add_request(make_request("a", 8, 4), 0)
    s.add_request(make_request("b", 8, 4), 0)
    assert s.queue_position("b") == 1
    s.abort("b", 0.1)
    assert s.queue_position("b") is None and s.stats().waiting == 1


def test_deadline_times_out_running_work() -> None:
    s = make_scheduler("scheduler.tokenBudget=64", "kvCache.numBlocks=64")
    r = make_request("r", 8, 100, deadline=3.0)
    s.add_request(r, 0)
    t = 0.0
    while s.has_work():
        step(s, t)
        t += 1.0
    assert r.status is RequestStatus.TIMED_OUT and r.finish_time == 3.0 and r.num_output_tokens == 3
    assert s.kv.num_used == 0


def test_swap_preemption_and_swap_in() -> None:
    s = make_scheduler("scheduler.tokenBudget=32", "scheduler.preemptionMode=swap", "kvCache.blockSize=2",
                       "kvCache.numBlocks=12", "kvCache.swapBlocks=12")
    a, b = make_request("a", 8, 12, arrival=0), make_request("b", 8, 12, arrival=0.5)
    s.add_request(a, 0)
    s.add_request(b, 0.5)
    t, swapped = 0.0, False
    while s.has_work():
        plan, _ = step(s, t)
        if plan.swap_out:
            swapped = True
            assert plan.preempted == [("b", "swap", "kv_blocks")]  # latest arrival is the victim
            assert s.get_request("b").status is RequestStatus.SWAPPED
        t += 1.0
        s.kv.check_invariants()
    assert swapped
    assert a.status is b.status is RequestStatus.FINISHED
    assert b.num_output_tokens == 12 and b.num_preemptions >= 1
    kinds = {e.kind for e in s.drain_events()}
    assert {"swap_out", "swap_in", "preempt"} <= kinds


def test_swap_falls_back_to_recompute_when_host_space_is_full() -> None:
    s = make_scheduler("scheduler.tokenBudget=32", "scheduler.preemptionMode=swap", "kvCache.blockSize=2",
                       "kvCache.numBlocks=12", "kvCache.swapBlocks=1")
    a, b = make_request("a", 8, 12), make_request("b", 8, 12, arrival=0.5)
    s.add_request(a, 0)
    s.add_request(b, 0.5)
    t, preempted = 0.0, []
    while s.has_work():
        plan, _ = step(s, t)
        preempted += plan.preempted
        t += 1.0
    assert ("b", "recompute", "kv_blocks+swap_space_full") in preempted
    assert b.status is RequestStatus.FINISHED and b.num_output_tokens == 12


def _auto_run(cost, swap_blocks: int = 12) -> tuple[list, list]:
    s = Scheduler(resolve_config(None, ["scheduler.tokenBudget=32", "scheduler.preemptionMode=auto",
                                        "kvCache.blockSize=2", "kvCache.numBlocks=12",
                                        f"kvCache.swapBlocks={swap_blocks}"]), cost_model=cost)
    a, b = make_request("a", 8, 12), make_request("b", 8, 12, arrival=0.5)
    s.add_request(a, 0)
    s.add_request(b, 0.5)
    t, preempted = 0.0, []
    while s.has_work():
        plan, _ = step(s, t)
        preempted += plan.preempted
        t += 1.0
        s.kv.check_invariants()
    assert a.status is b.status is RequestStatus.FINISHED and b.num_output_tokens == 12
    return preempted, [e for e in s.drain_events() if e.kind == "preempt"]


def test_auto_preemption_swaps_when_the_copy_is_cheaper_and_logs_both_figures() -> None:
    # Recompute: 1 ms a prefill token; swap: 0.01 ms a token moved (each way).
    preempted, events = _auto_run(LinearCost(base=0.01, per_prefill_token=0.001, per_swap_token=0.00001))
    assert preempted and all(mode == "swap" for _, mode, _ in preempted)
    ev = events[0]
    assert ev.detail["mode"] == "swap" and ev.detail["auto"] == "swap_cheaper"
    computed, blocks = ev.detail["computed_tokens"], ev.detail["blocks"]
    assert ev.detail["recompute_s"] == pytest.approx(0.001 * computed)
    assert ev.detail["swap_s"] == pytest.approx(0.00001 * 2 * blocks * 2)


def test_auto_preemption_recomputes_when_recompute_is_cheaper_or_host_space_is_short() -> None:
    slow_copy = LinearCost(base=0.01, per_prefill_token=0.00001, per_swap_token=0.001)
    preempted, events = _auto_run(slow_copy)
    assert preempted and all(mode == "recompute" for _, mode, _ in preempted)
    assert events[0].detail["auto"] == "recompute_cheaper"
    assert events[0].detail["swap_s"] > events[0].detail["recompute_s"]
    fast_copy = LinearCost(base=0.01, per_prefill_token=0.001, per_swap_token=0.00001)
    preempted, events = _auto_run(fast_copy, swap_blocks=0)  # auto with no host space is allowed: it recomputes
    assert preempted and all(mode == "recompute" for _, mode, _ in preempted)
    assert events[0].detail["auto"] == "swap_space_full"


def test_auto_preemption_charges_the_attention_a_recompute_redoes() -> None:
    """Recompute is charged chunk by chunk as the scheduler would run it, each chunk reading the
    positions before it, so a long victim costs more than its token count on the prefill curve,
    and that can make swapping it the cheaper choice."""
    from types import SimpleNamespace

    def table(pair: float, context: float) -> TableCost:
        # An empty step 10 ms; 16 prefill tokens 26 ms (1 ms a token); swap 0.8 ms a token moved.
        return TableCost(decode_batch_sizes=(0, 8), prefill_tokens=(0, 16), seconds=((0.010, 0.026), (0.020, 0.036)),
                         per_swap_token=0.0008, block_size=2, per_decode_context_token=context,
                         per_attention_pair=pair)

    def scheduler(cost: TableCost) -> Scheduler:
        return Scheduler(resolve_config(None, ["scheduler.tokenBudget=64", "scheduler.prefillChunkSize=16",
                                               "scheduler.preemptionMode=auto", "kvCache.blockSize=2",
                                               "kvCache.numBlocks=64", "kvCache.swapBlocks=64"]), cost_model=cost)

    victim = SimpleNamespace(num_computed_tokens=48, block_ids=list(range(24)))
    flat = scheduler(table(0.0, 0.0))
    assert flat._recompute_seconds(48) == pytest.approx(3 * 0.016)
    choice, figures = flat._preemption_by_cost(victim)
    assert choice == "recompute" and figures["swap_s"] == pytest.approx(0.0008 * 2 * 48)

    deep = scheduler(table(pair=1e-4, context=1e-4))
    # Chunks at 0, 16 and 32 read 0 + 16 + 32 earlier positions and add 16 * start pairs each
    # beyond the table's own (a chunk from position 0).
    assert deep._recompute_seconds(48) == pytest.approx(3 * 0.016 + 1e-4 * 48 + 1e-4 * 16 * 48)
    # 40 tokens: chunks at 0 and 16, then 8 tokens at 32 (half the table's 16-token rise, 32
    # positions read, 8 * 32 + 36 pairs against the 68 the table interpolates for 8 tokens).
    last = 0.008 + 1e-4 * 32 + 1e-4 * (8 * 32 + 36 - 68)
    assert deep._recompute_seconds(40) == pytest.approx(0.016 + (0.016 + 1e-4 * 16 + 1e-4 * 256) + last)
    choice, figures = deep._preemption_by_cost(victim)
    assert choice == "swap" and figures["auto"] == "swap_cheaper"
    assert figures["recompute_s"] > figures["swap_s"]


def test_auto_preemption_needs_a_cost_model_and_swap_needs_swap_blocks() -> None:
    with pytest.raises(ValueError, match="preemptionMode auto"):
        make_scheduler("scheduler.preemptionMode=auto")
    with pytest.raises(ConfigError, match=r"scheduler.preemptionMode swap.*kvCache.swapBlocks is 0"):
        resolve_config(None, ["scheduler.preemptionMode=swap"])


def test_tenant_running_quota_caps_a_tenant() -> None:
    s = make_scheduler("scheduler.maxSequences=4", "scheduler.tokenBudget=64", "kvCache.numBlocks=256",
                       "scheduler.tenantQuotas=[{name: heavy, maxRunningShare: 0.5}]")
    for i in range(6):
        s.add_request(make_request(f"h{i}", 4, 50, tenant="heavy"), 0)
    s.add_request(make_request("q0", 4, 50, tenant="quiet"), 0.1)
    step(s, 0.2)
    running = [r.tenant for r in s.running.values()]
    assert running.count("heavy") == 2 and "quiet" in running
    assert any(e.kind == "defer" and e.reason == "tenant_quota" for e in s.drain_events())


def test_lookahead_tokens_count_against_the_budget() -> None:
    s = make_scheduler("scheduler.tokenBudget=8", "scheduler.prefillChunkSize=8", "scheduler.maxLookaheadTokens=3",
                       "kvCache.numBlocks=64", "kvCache.blockSize=4")
    for i in range(3):
        s.add_request(make_request(f"r{i}", 2, 20, num_lookahead=3), 0)
    step(s, 0)  # all three prompts (6 tokens)
    plan, _ = step(s, 1)
    # Each decode costs 1 + 3 lookahead: only two fit in 8.
    assert [(q.request_id, q.num_lookahead) for q in plan.seqs] == [("r0", 3), ("r1", 3)]
    assert sum(q.num_tokens + q.num_lookahead for q in plan.seqs) <= 8
    for q in plan.seqs:
        assert len(q.block_table) * 4 >= q.start_position + 1 + q.num_lookahead


def test_accepted_draft_tokens_advance_computed_and_outputs() -> None:
    s = make_scheduler("scheduler.tokenBudget=16", "scheduler.maxLookaheadTokens=2", "kvCache.numBlocks=64")
    r = make_request("r", 4, 10, num_lookahead=2)
    s.add_request(r, 0)
    step(s, 0)
    plan = s.schedule(1)
    out = RunnerOutput(sampled={"r": [SampledToken(5), SampledToken(6), SampledToken(8)]})
    (u,) = s.update_from_output(plan, out, 2)
    assert u.new_token_ids == [5, 6, 8] and r.num_output_tokens == 4
    assert r.num_computed_tokens == r.num_tokens - 1


def test_eos_and_stop_token_ids_finish_without_returning_the_token() -> None:
    s = make_scheduler("kvCache.numBlocks=64")
    a = make_request("a", 4, 10, eos_token_ids=[2])
    a.sampling = SamplingParams(max_tokens=10)
    b = make_request("b", 4, 10)
    b.sampling = SamplingParams(max_tokens=10, stop_token_ids=[2], ignore_eos=True)
    s.add_request(a, 0)
    s.add_request(b, 0)
    plan, updates = step(s, 0, token=2)
    assert {(u.request_id, tuple(u.new_token_ids), u.finished, u.finish_reason) for u in updates} == {
        ("a", (), True, "stop"), ("b", (), True, "stop")}
    assert s.kv.num_used == 0


def test_runner_failure_fails_one_request_alone() -> None:
    s = make_scheduler("kvCache.numBlocks=64")
    s.add_request(make_request("a", 4, 4), 0)
    s.add_request(make_request("b", 4, 4), 0)
    plan = s.schedule(0)
    out = fake_output(plan)
    out.failed["a"] = "nan in logits"
    updates = {u.request_id: u for u in s.update_from_output(plan, out, 1)}
    assert updates["a"].finished and updates["a"].finish_reason == "error: nan in logits"
    assert not updates["b"].finished and updates["b"].new_token_ids == [7]


def test_finish_request_for_a_matched_stop_string() -> None:
    s = make_scheduler("kvCache.numBlocks=64")
    r = make_request("r", 4, 100)
    s.add_request(r, 0)
    step(s, 0)
    s.finish_request("r", 1.0)
    assert r.status is RequestStatus.FINISHED and r.finish_reason == "stop" and s.kv.num_used == 0
    assert not s.has_work()


def test_shedding_rejects_the_shed_classes() -> None:
    s = make_scheduler("kvCache.numBlocks=64")
    s.set_shedding({"batch"})
    d = s.add_request(make_request("r", 4, 4, priority_class="batch"), 0)
    assert (d.accepted, d.reason) == (False, "shedding") and d.retry_after_s is not None
    assert s.add_request(make_request("i", 4, 4, priority_class="interactive"), 0).accepted
    assert s.stats().rejections == {"shedding": 1}


def test_prefix_cache_hit_skips_computed_blocks_within_one_isolation_key() -> None:
    s = make_scheduler("kvCache.blockSize=4", "kvCache.numBlocks=64")
    prompt = list(range(100, 117))  # 17 tokens: 4 full blocks
    a = make_request("a", prompt, 2, cache_key="m@rev1|t1")
    s.add_request(a, 0)
    while s.has_work():
        step(s, 0)
    b = make_request("b", prompt, 2, cache_key="m@rev1|t1")
    c = make_request("c", prompt, 2, cache_key="m@rev1|t2")
    s.add_request(b, 1)
    s.add_request(c, 1)
    plan = s.schedule(1)
    assert {q.request_id: (q.start_position, q.num_tokens) for q in plan.seqs} == {"b": (16, 1), "c": (0, 17)}
    assert b.num_cached_tokens == 16 and c.num_cached_tokens == 0


def test_plan_puts_decodes_first() -> None:
    s = make_scheduler("scheduler.tokenBudget=16", "scheduler.prefillChunkSize=8", "kvCache.numBlocks=64")
    s.add_request(make_request("a", 2, 5), 0)
    step(s, 0)
    s.add_request(make_request("b", 12, 5), 1)
    plan, _ = step(s, 1)
    assert shape(plan) == [("a", 1, True), ("b", 8, False)]


def test_stats_are_snapshots_with_counters() -> None:
    s = make_scheduler("kvCache.numBlocks=64", "kvCache.blockSize=4")
    s.add_request(make_request("a", 8, 2), 0)
    before = s.stats()
    step(s, 0)
    step(s, 1)
    after = s.stats()
    assert (before.waiting, before.running, before.finished) == (1, 0, {})
    assert after.finished == {"finished": 1} and after.generation_tokens_total == 2
    assert after.prompt_tokens_total == 8 and after.kv_used_blocks == 0 and after.kv_total_blocks == 64
