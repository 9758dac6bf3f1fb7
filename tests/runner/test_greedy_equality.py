"""Greedy output of the paged runner equals stock Hugging Face `generate`, token for token.

Six prompts of different lengths (1..~110 tokens), each way the scheduler can cut the work:
one at a time, all at once, 16-token prefill chunks, forced recompute, forced swap.
"""

from __future__ import annotations

import pytest

from .conftest import MAX_NEW, Preempt, ToySeq, greedy

pytestmark = pytest.mark.model


def _seqs(prompt_ids: list[list[int]]) -> list[ToySeq]:
    return [ToySeq(f"r{i}", ids, greedy()) for i, ids in enumerate(prompt_ids)]


def test_one_at_a_time(driver_factory, prompt_ids, hf_reference):
    d = driver_factory()
    for ids, ref in zip(prompt_ids, hf_reference):
        s = ToySeq("solo", ids, greedy())
        d.run([s], MAX_NEW)
        assert s.out == ref


def test_all_at_once(driver_factory, prompt_ids, hf_reference):
    seqs = _seqs(prompt_ids)
    driver_factory().run(seqs, MAX_NEW)
    assert [s.out for s in seqs] == hf_reference


def test_prefill_chunks_of_16_mixed_with_decodes(driver_factory, prompt_ids, hf_reference):
    seqs = _seqs(prompt_ids)
    d = driver_factory(chunk=16)
    d.run(seqs, MAX_NEW)
    assert [s.out for s in seqs] == hf_reference
    assert d.steps > MAX_NEW  # the long prompts really were split across steps


def test_preemption_by_recompute(driver_factory, prompt_ids, hf_reference):
    seqs = _seqs(prompt_ids)
    # Drop the two longest mid-decode; they re-prefill prompt + generated tokens and continue.
    preempt = [Preempt(5, "r5", "recompute"), Preempt(7, "r4", "recompute"), Preempt(9, "r5", "recompute")]
    driver_factory(chunk=32).run(seqs, MAX_NEW, preempt)
    assert [s.out for s in seqs] == hf_reference


def test_preemption_by_swap(driver_factory, prompt_ids, hf_reference):
    seqs = _seqs(prompt_ids)
    # Swapped out mid-decode and back into different device blocks, while others keep running.
    preempt = [Preempt(4, "r5", "swap", resume_after=2), Preempt(6, "r3", "swap", resume_after=1)]
    driver_factory().run(seqs, MAX_NEW, preempt)
    assert [s.out for s in seqs] == hf_reference


def test_context_length_buckets(driver_factory, prompt_ids, hf_reference, monkeypatch):
    from magnitude.runner import attention

    # Every prompt length here is under the default bucket floor; lower it so the step really
    # splits into several decode and chunk groups of different padded lengths.
    monkeypatch.setattr(attention, "BUCKET_MIN_LEN", 1)
    slices = [attention.SeqSlice(0, 1, n - 1, []) for n in (3, 5, 7, 20, 100)]
    assert [[s.start + s.n for s in b] for b in attention._buckets(slices)] == [[3, 5], [7], [20], [100]]
    seqs = _seqs(prompt_ids)
    driver_factory(chunk=24).run(seqs, MAX_NEW)
    assert [s.out for s in seqs] == hf_reference
