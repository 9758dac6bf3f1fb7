"""DESIGN §2's worked example, step by step: budget 16, chunk 8, A = 24-token prompt (4 outputs),
B = 4-token prompt with 8 outputs. Step 1 runs 8 of A and 4 of B; then B decodes every step."""

from __future__ import annotations

from sched_helpers import fake_output, make_request, make_scheduler, shape

# One row per step: the plan's (request, tokens, samples) list, decodes first.
EXPECTED = [
    [("A", 8, False), ("B", 4, True)],  # A's first chunk shares the step with B's whole prompt
    [("B", 1, True), ("A", 8, False)],  # B decodes; A's second chunk
    [("B", 1, True), ("A", 8, True)],  # A's last chunk computes its prompt's end: first token
    [("A", 1, True), ("B", 1, True)],
    [("A", 1, True), ("B", 1, True)],
    [("A", 1, True), ("B", 1, True)],  # A's 4th token: A finishes
    [("B", 1, True)],
    [("B", 1, True)],  # B's 8th token: B finishes
]


def test_worked_example_step_by_step() -> None:
    s = make_scheduler("scheduler.tokenBudget=16", "scheduler.prefillChunkSize=8", "kvCache.blockSize=4",
                       "kvCache.numBlocks=64")
    a, b = make_request("A", 24, 4), make_request("B", 4, 8)
    assert s.add_request(a, 0.0).accepted and s.add_request(b, 0.0).accepted
    got = []
    t = 0.0
    while s.has_work():
        plan = s.schedule(t)
        got.append(shape(plan))
        assert plan.num_tokens <= 16
        t += 1.0
        s.update_from_output(plan, fake_output(plan), t)
    assert got == EXPECTED
    assert (a.first_token_time, a.finish_time) == (3.0, 6.0)
    assert (b.first_token_time, b.finish_time) == (1.0, 8.0)
    assert b.token_times == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]  # B decodes every step
    assert a.finish_reason == b.finish_reason == "length"
    assert s.kv.num_used == 0
    s.kv.check_invariants()


def test_block_tables_cover_positions_and_grow_append_only() -> None:
    s = make_scheduler("scheduler.tokenBudget=16", "scheduler.prefillChunkSize=8", "kvCache.blockSize=4",
                       "kvCache.numBlocks=64")
    a = make_request("A", 24, 4)
    s.add_request(a, 0.0)
    previous: list[int] = []
    t = 0.0
    while s.has_work():
        plan = s.schedule(t)
        for seq in plan.seqs:
            end = seq.start_position + seq.num_tokens
            assert len(seq.block_table) * 4 >= end
            assert seq.block_table[: len(previous)] == previous
            previous = list(seq.block_table)
        t += 1.0
        s.update_from_output(plan, fake_output(plan), t)
