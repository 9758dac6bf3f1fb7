"""Per-request sampling parameters: a pure, validated dataclass shared by server, engine and runner."""

from __future__ import annotations

from dataclasses import dataclass, field

# Below this, sampling is greedy (vLLM's _SAMPLING_EPS). Such a distribution is one-hot anyway
# unless logits tie within 1e-5, and dividing by a temperature near float32's smallest values
# (1e-40 is subnormal) overflows the logits to inf, which no sampler can draw from.
GREEDY_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingParams:
    """How one request's next tokens are chosen and when generation stops.

    A temperature below GREEDY_TEMPERATURE (0 included) means greedy. `max_tokens` counts
    generated tokens. `stop` strings are cut from the output exactly (the stop string itself is
    not returned); `stop_token_ids` end the request after that token, which is not returned either. `ignore_eos` generates exactly
    `max_tokens` (benchmarks). `logprobs` is the number of top alternatives to return per token
    (None: no logprobs).
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

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1
