"""Per-request sampling parameters: a pure, validated dataclass shared by server, engine and runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

# Below this, sampling is greedy (vLLM's _SAMPLING_EPS). Such a distribution is one-hot anyway
# unless logits tie within 1e-5, and dividing by a temperature near float32's smallest values
# (1e-40 is subnormal) overflows the logits to inf, which no sampler can draw from.
GREEDY_TEMPERATURE = 1e-5
MAX_REPETITION_PENALTY = 10.0  # beyond this every seen token is banned in effect; likely a unit mistake


class TokenConstraint(Protocol):
    """Which tokens may come next for one request (structured outputs, tool calls): a grammar
    matcher's state, advanced by every token the request keeps. The runner asks it for a row of
    the step's token bitmask before sampling and tells it the token chosen after."""

    def fill_next_token_bitmask(self, bitmask: Any, row: int) -> None: ...

    def accept_token(self, token_id: int) -> bool: ...


@dataclass(slots=True)
class SamplingParams:
    """How one request's next tokens are chosen and when generation stops.

    A temperature below GREEDY_TEMPERATURE (0 included) means greedy. `max_tokens` counts
    generated tokens. `stop` strings are cut from the output exactly (the stop string itself is
    not returned); `stop_token_ids` end the request after that token, which is not returned either. `ignore_eos` generates exactly
    `max_tokens` (benchmarks). `logprobs` is the number of top alternatives to return per token
    (None: no logprobs).

    `constraint` (structured outputs, tool calls) masks the tokens its grammar forbids before
    anything else, so greedy rows, penalties, filters and logprobs all see the masked
    distribution (logprobs then report it, not the model's raw one).

    Logit adjustments, applied to greedy and random rows alike before any filter (vLLM's
    semantics): `repetition_penalty` (>1 discourages every token already in the prompt or the
    output: positive logits divided by it, negative ones multiplied), `frequency_penalty` (minus
    this times the token's count in the output) and `presence_penalty` (minus this once the token
    is in the output), then `logit_bias` (token id -> added to its logit; -100 bans, +100
    all but forces). `min_p` keeps the tokens at least `min_p` times as likely as the most likely
    one (after temperature).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    constraint: TokenConstraint | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for token, bias in self.logit_bias.items():
            if token < 0 or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias must map token ids >= 0 to values in [-100, 100], got {token}: {bias}")

    @property
    def penalized(self) -> bool:
        """Whether the next token depends on the tokens so far (the sampler then needs them)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the model's logits are changed before choosing (greedy rows too)."""
        return self.penalized or bool(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1
