"""Data-only contracts between the scheduler and whatever executes a step.

`Scheduler.schedule()` returns a `StepPlan`; the runner (the real model, or the simulator's
cost model) executes it and returns a `RunnerOutput`; `Scheduler.update_from_output()` takes
that back. Nothing here imports torch: the runner reads plain ints and lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from magnitude.engine.request import RequestStatus
from magnitude.engine.sampling import SamplingParams


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step.

    The runner computes KV for `token_ids` at positions `start_position ..
    start_position + len(token_ids) - 1`, writing into the blocks of `block_table` (slot of
    position p = block_table[p // block_size] * block_size + p % block_size), attending
    causally to every earlier position of this sequence already in those blocks.
    If `sample` is set, the chunk reaches the end of the sequence's known tokens, and the
    runner samples the next token from the logits of the last position (plus
    `num_lookahead` draft positions when speculative decoding exists).
    """

    request_id: str
    token_ids: list[int]
    start_position: int
    block_table: list[int]
    sample: bool
    sampling: SamplingParams
    num_output_tokens: int = 0  # tokens generated so far (seeded samplers use it as the step index)
    num_lookahead: int = 0
    # The request's prompt and generated tokens so far, for penalties (the scheduler's own lists,
    # not copies: read during the step, appended to only after it).
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class AttentionLoad(NamedTuple):
    """The attention a step does, for cost models that charge it (sim/cost.py TableCost): the
    context every sequence reads (a decode its context plus itself, a prefill chunk the positions
    before it), the tokens computed beside the decodes' own (prefill chunks, draft positions), and
    their query-key pairs (n tokens from position s: n*s + n(n+1)/2)."""

    contexts: int = 0
    chunk_tokens: int = 0
    pairs: int = 0

    def plus_decode(self, start: int, lookahead: int = 0) -> "AttentionLoad":
        """A decode at `start` with `lookahead` draft positions after it (start+1 ...)."""
        k = lookahead
        return AttentionLoad(self.contexts + start + 1, self.chunk_tokens + k,
                             self.pairs + k * (start + 1) + k * (k + 1) // 2)

    def plus_chunk(self, start: int, n: int) -> "AttentionLoad":
        return AttentionLoad(self.contexts + start, self.chunk_tokens + n, self.pairs + n * start + n * (n + 1) // 2)

    def minus(self, other: "AttentionLoad") -> "AttentionLoad":
        return AttentionLoad(self.contexts - other.contexts, self.chunk_tokens - other.chunk_tokens,
                             self.pairs - other.pairs)


@dataclass(slots=True)
class StepPlan:
    """Everything one step does. Decodes come first in `seqs`, then prefill chunks."""

    step_id: int
    seqs: list[ScheduledSeq] = field(default_factory=list)
    # (device block, host block) copies to run BEFORE the forward pass.
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Requests preempted this step: (request_id, mode, reason).
    preempted: list[tuple[str, str, str]] = field(default_factory=list)
    # Requests released at the start of this step (finished, cancelled, timed out).
    released: list[str] = field(default_factory=list)
    # Whether the scheduler gives decodes their lookahead now (`auto` turns it off where it loses):
    # while off a draft model skips its forwards and catches up when drafting resumes.
    speculating: bool = True

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def num_decode(self) -> int:
        return sum(1 for s in self.seqs if s.sample and len(s.token_ids) == 1)

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.swap_out and not self.swap_in

    def attention_load(self) -> AttentionLoad:
        """What this step's sequences read and attend, draft positions included."""
        load = AttentionLoad()
        for s in self.seqs:
            n = len(s.token_ids)
            if s.sample and n == 1:
                load = load.plus_decode(s.start_position, s.num_lookahead)
            else:
                load = load.plus_chunk(s.start_position, n + s.num_lookahead)
        return load


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass(slots=True)
class RunnerOutput:
    """What the runner produced for a StepPlan: sampled tokens per request that had `sample` set,
    and per-request failures (one bad request fails alone, not the step)."""

    sampled: dict[str, list[SampledToken]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    duration_s: float = 0.0
    # Speculative decoding: draft tokens proposed per request this step (absent: none proposed).
    # Accepted drafts are `len(sampled[rid]) - 1`.
    num_drafts: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class RequestUpdate:
    """What one step did to one request, as `Scheduler.update_from_output` reports it.

    `new_token_ids` excludes stop/EOS tokens that ended the request. `status` is the request's
    status after the step."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    status: RequestStatus
    finish_reason: str | None = None
