"""One request's state in the num_computed_tokens framing.

A request knows its tokens (prompt + generated) and how many of them have KV computed.
The scheduler assigns tokens so `num_computed_tokens` catches up to `num_tokens`; it never
asks whether a request is "in prefill" or "in decode". The last generated token is never
computed yet: it is the next step's input. Pure data, no policy.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from magnitude.engine.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, no device blocks (new, or preempted by recompute)
    RUNNING = "running"  # resident: holds device blocks
    SWAPPED = "swapped"  # preempted by swap: holds host blocks
    FINISHED = "finished"
    CANCELLED = "cancelled"
    REJECTED = "rejected"
    TIMED_OUT = "timed_out"

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset(
    {RequestStatus.FINISHED, RequestStatus.CANCELLED, RequestStatus.REJECTED, RequestStatus.TIMED_OUT}
)


@dataclass(eq=False)
class Request:
    """A generation request. Fields above the marker come from the caller; the rest is state.

    `prompt_token_ids` is None in the simulator: then only `num_prompt_tokens` matters, token ids
    handed to the runner are placeholders and prefix caching is off for the request.
    """

    request_id: str
    prompt_token_ids: list[int] | None
    num_prompt_tokens: int
    sampling: SamplingParams
    arrival_time: float
    priority_class: str = ""  # "" takes the config's defaultPriorityClass
    tenant: str = "default"
    deadline: float | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    cache_key: str = ""
    num_lookahead: int = 0  # speculative draft tokens wanted per decode (capped by maxLookaheadTokens)

    # ---- state (owned by the scheduler) ----
    spec_proposed: int = 0  # draft tokens the runner proposed for this request
    spec_accepted: int = 0  # ... and how many of them verification kept
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)  # device block table (append-only while resident)
    admitted_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at (last) admission
    # Scheduler bookkeeping: priority level of the class and the queue generation of the live entry.
    priority: int = 0
    queue_seq: int = -1
    last_prefill_step: int = -1
    last_defer_reason: str | None = None
    # What admission expects the output to be when max_tokens is only a cap (set by the scheduler
    # when the request arrives: the measured mean output length, or admission.expectedOutputTokens).
    output_estimate: int | None = None

    def __post_init__(self) -> None:
        if self.prompt_token_ids is not None:
            self.num_prompt_tokens = len(self.prompt_token_ids)
        if self.num_prompt_tokens < 1:
            raise ValueError(f"request {self.request_id!r}: prompt must have at least one token")

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: the target `num_computed_tokens` catches up to."""
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens

    @property
    def max_total_tokens(self) -> int:
        """Most KV positions this request can ever need (the last sampled token is never computed)."""
        return self.num_prompt_tokens + self.sampling.max_tokens - 1

    @property
    def expected_output_tokens(self) -> int:
        """The output length admission plans for: max_tokens when it is the length (ignore_eos) or
        no estimate is set; else the estimate, but never less than what is generated plus one."""
        if self.sampling.ignore_eos or self.output_estimate is None:
            return self.sampling.max_tokens
        return min(self.sampling.max_tokens, max(self.output_estimate, self.num_output_tokens + 1))

    @property
    def remaining_work_tokens(self) -> int:
        """Tokens still to compute, counting the outputs expected but not yet generated (admission's
        demand estimate: a request without max_tokens may run to the end of the context, but
        counting that cap would make every such request look context-long)."""
        return max(0, self.num_prompt_tokens + self.expected_output_tokens - 1 - self.num_computed_tokens)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end); zeros stand in for a prompt the simulator never saw."""
        p = self.num_prompt_tokens
        if self.prompt_token_ids is not None:
            if end <= p:
                return self.prompt_token_ids[start:end]
            if start >= p:
                return self.output_token_ids[start - p : end - p]
            return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return [0] * (min(end, p) - start) + self.output_token_ids[: max(0, end - p)]

    def all_token_ids(self) -> list[int]:
        return self.token_ids(0, self.num_tokens)
