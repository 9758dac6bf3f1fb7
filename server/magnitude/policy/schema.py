"""The one policy schema: scheduler, KV cache and admission settings.

This document is, without translation, the CRD's engine-facing spec (`spec.scheduler`,
`spec.kvCache`, `spec.admission`), the engine's `--config` file and the simulator's
`--config`. Field names are camelCase on the wire (aliases) and snake_case in Python.
Pure: pydantic only, no I/O.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
# What a null tokenBudget / prefillChunkSize means where no cost model in seconds exists (a bare
# Scheduler, the simulator's unit model): the fixed defaults these fields had before derivation.
STATIC_TOKEN_BUDGET = 2048
STATIC_PREFILL_CHUNK = 512


class PolicyModel(BaseModel):
    """Base: camelCase aliases, unknown keys refused, values validated on assignment."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
    )

    def to_document(self) -> dict:
        """The wire form (camelCase, JSON types) used by CRDs, config files and reports."""
        return self.model_dump(mode="json", by_alias=True)


class PriorityClass(PolicyModel):
    """A named priority level. Lower `priority` runs first."""

    name: str = Field(pattern=DNS_LABEL, description="Name clients send as `priority_class`.")
    priority: int = Field(ge=0, le=100, description="Priority level; lower runs first.")
    shed_order: int | None = Field(
        default=None,
        ge=0,
        le=100,
        description="When load shedding is on, classes are shed from the highest shedOrder "
        "down; defaults to `priority` (least important first).",
    )


class TenantQuota(PolicyModel):
    """Caps one tenant's share of the running set and of each step's tokens."""

    name: str = Field(min_length=1, max_length=253, description="Tenant name (from `user` or X-Tenant).")
    max_running_share: float = Field(
        default=1.0, gt=0.0, le=1.0, description="Largest fraction of maxSequences this tenant may hold."
    )
    max_token_share: float = Field(
        default=1.0, gt=0.0, le=1.0, description="Largest fraction of a step's token budget this tenant may use."
    )
    weight: float = Field(default=1.0, gt=0.0, le=1000.0, description="Fair-share weight among tenants.")


def _default_priority_classes() -> list[PriorityClass]:
    return [
        PriorityClass(name="interactive", priority=0),
        PriorityClass(name="standard", priority=1),
        PriorityClass(name="batch", priority=2),
    ]


class SchedulerPolicy(PolicyModel):
    """Per-step scheduling: budgets, chunking, priorities, fairness, preemption."""

    token_budget: int | None = Field(
        default=None, ge=1, le=1_048_576,
        description="Most tokens (decode + prefill) computed in one step. Null (the default) derives it: the "
        "largest step of prefill tokens the engine's measured cost model predicts within itlTargetMs, or, with "
        "prefillChunkSize and itlTargetMs null too and the default step raised for the decodes (itlTargetMs), "
        "that step.",
    )
    max_sequences: int = Field(default=64, ge=1, le=4096, description="Most sequences resident in one step.")
    prefill_chunk_size: int | None = Field(
        default=None,
        ge=1,
        le=1_048_576,
        description="Most prompt tokens one sequence may compute in one step. Null (the default) derives it: "
        "what a step with 8 decodes leaves within itlTargetMs under the measured cost model, or, with tokenBudget "
        "and itlTargetMs null too and the default step raised for the decodes (itlTargetMs), that step.",
    )
    itl_target_ms: float | None = Field(
        default=None, gt=0.0, le=60_000.0,
        description="Inter-token latency target: each step's total predicted time (decodes plus every prefill "
        "chunk) stays within it while requests decode, and null tokenBudget/prefillChunkSize are derived "
        "for it. Null: when anything is derived, the predicted time of an efficient step beside 8 decodes (the "
        "smallest prefill step within 90% of the rate a line fitted through the measured prefill-only steps allows; "
        "where that step beside 8 decodes is predicted over 200 ms, the largest within 200 ms if it keeps 80% of "
        "the rate; raised where steps beside 8 decodes reach 90% only at a bigger size, to that size, but to none "
        "predicted over 200 ms), plus a margin for how served steps scatter about their predictions (so it may "
        "exceed 200 ms by that margin); else no per-step bound.",
    )
    preemption_mode: Literal["recompute", "swap", "auto"] = Field(
        default="recompute",
        description="How a victim gives up its KV blocks when memory runs out: recompute (drop them, prefill "
        "again), swap (copy them to kvCache.swapBlocks host blocks, which must be more than 0), or auto (per "
        "victim, whichever the measured cost model says is cheaper: recomputing its tokens or copying its "
        "blocks out and back; recompute when host space is short).",
    )
    priority_classes: list[PriorityClass] = Field(
        default_factory=_default_priority_classes, min_length=1, max_length=16
    )
    default_priority_class: str = Field(default="standard", pattern=DNS_LABEL)
    aging_seconds_per_level: float | None = Field(
        default=10.0,
        gt=0.0,
        le=86_400.0,
        description="A waiting request gains one priority level per this many seconds since arrival; null disables aging.",
    )
    tenant_fairness: bool = Field(default=True, description="Share admission fairly among tenants at the same level.")
    tenant_quotas: list[TenantQuota] = Field(default_factory=list, max_length=256)
    default_tenant_max_running_share: float = Field(
        default=1.0, gt=0.0, le=1.0, description="maxRunningShare for tenants without a quota entry."
    )
    max_lookahead_tokens: int = Field(
        default=0, ge=0, le=16, description="Speculative draft tokens a decode may carry; budgeted like any token."
    )

    @model_validator(mode="after")
    def _check_cross_fields(self) -> "SchedulerPolicy":
        names = [c.name for c in self.priority_classes]
        if len(set(names)) != len(names):
            raise ValueError(f"priorityClasses: duplicate names in {names}")
        if self.default_priority_class not in names:
            raise ValueError(
                f"defaultPriorityClass: {self.default_priority_class!r} is not one of the priorityClasses {names}"
            )
        # A chunk larger than tokenBudget is not an error: the scheduler caps it at the budget, so
        # `--set scheduler.tokenBudget=16` works with the default chunk and documents round-trip.
        tenants = [q.name for q in self.tenant_quotas]
        if len(set(tenants)) != len(tenants):
            raise ValueError("tenantQuotas: duplicate tenant names")
        return self

    def priority_of(self, class_name: str) -> int:
        """The priority level of a class; KeyError names the known classes."""
        for c in self.priority_classes:
            if c.name == class_name:
                return c.priority
        raise KeyError(f"unknown priority class {class_name!r}; known: {[c.name for c in self.priority_classes]}")

    def shed_order(self) -> list[str]:
        """Class names in the order load shedding drops them: least important first (highest
        shedOrder, which defaults to priority), ties by name. Shared by the engine and the operator."""
        key = lambda c: (-(c.shed_order if c.shed_order is not None else c.priority), c.name)  # noqa: E731
        return [c.name for c in sorted(self.priority_classes, key=key)]

    def quota_of(self, tenant: str) -> TenantQuota:
        for q in self.tenant_quotas:
            if q.name == tenant:
                return q
        return TenantQuota(name=tenant or "default", max_running_share=self.default_tenant_max_running_share)


class KVCachePolicy(PolicyModel):
    """The paged KV cache: block geometry, capacity, element type, host swap space, prefix caching."""

    block_size: int = Field(default=16, ge=1, le=1024, description="Tokens per KV block.")
    num_blocks: int | None = Field(
        default=None, ge=1, le=10_000_000, description="Device blocks; null sizes the cache from memoryFraction."
    )
    memory_fraction: float = Field(
        default=0.9, gt=0.0, le=1.0,
        description="With numBlocks null: the share of the device's available memory (GPU: free memory; CPU: "
        "MemAvailable, capped by the container's memory limit) plus the weights that weights, activations "
        "(a tenth of the weights) and the KV cache may use together.",
    )
    swap_blocks: int = Field(default=0, ge=0, le=10_000_000, description="Host blocks for swap preemption.")
    dtype: Literal["auto", "float32", "float16"] = Field(
        default="auto",
        description="What the KV cache stores keys and values in; attention sums in float32 either way. "
        "auto: float16 beside w4a16, w4a8, w4a16-int16 or w4a16-bf16prefill weights on the CPU (half the memory a token costs; the "
        "quantization's evaluation record measures the model with it), float32 beside any other "
        "weights on the CPU (unquantized: exact), the model's dtype on a GPU.",
    )
    enable_prefix_caching: bool = Field(default=True, description="Reuse full blocks of identical prefixes.")


class AdmissionPolicy(PolicyModel):
    """Bounded queue: reject early, with a reason and a Retry-After, instead of queueing forever."""

    max_queued_requests: int = Field(default=256, ge=1, le=1_000_000)
    max_queued_tokens: int = Field(
        default=262_144, ge=1, le=1_000_000_000, description="Bound on prompt + output tokens waiting."
    )
    max_queue_wait_seconds: float = Field(
        default=30.0, gt=0.0, le=3600.0, description="Reject when the estimated wait exceeds this."
    )
    max_tenant_queue_share: float = Field(
        default=0.5,
        gt=0.0,
        le=1.0,
        description="When the queue is more than half full, one tenant may hold at most this share of it, "
        "so a heavy tenant cannot get a quiet tenant rejected.",
    )
    max_model_len: int | None = Field(
        default=None, ge=1, le=10_000_000, description="Longest prompt + output; null takes the model's context."
    )
    default_max_tokens: int | None = Field(
        default=None, ge=1, le=1_000_000,
        description="max_tokens of a request that sets none; null: the rest of the context (as vLLM does).",
    )
    max_choices: int = Field(
        default=8, ge=1, le=128,
        description="Largest n (choices per request) a request may ask for; the choices share the prompt's KV blocks.",
    )
    expected_output_tokens: int = Field(
        default=256, ge=1, le=1_000_000,
        description="Output length admission counts for a request whose max_tokens is only a cap, until "
        "the engine has measured the mean output length of finished requests.",
    )


class QuantizationEvaluationPolicy(PolicyModel):
    """Thresholds a quantized model's evaluation record must meet before the engine serves it."""

    min_top1_agreement: float = Field(
        default=0.9, ge=0.0, le=1.0,
        description="Least teacher-forced top-1 agreement with the unquantized model over the evaluation text.",
    )
    max_mean_kl: float = Field(
        default=0.05, ge=0.0, le=100.0,
        description="Largest mean KL divergence (nats per token) from the unquantized model over the evaluation text.",
    )
    min_probes_passed: int | None = Field(
        default=None, ge=0, le=1000,
        description="Least behaviour probes (factual, JSON, arithmetic, long-context recall) the quantized model "
        "must pass among those the unquantized model passes; null: all of them.",
    )
    enforce: bool = Field(
        default=True,
        description="Below the thresholds the engine does not serve (readiness phase quantization_rejected); "
        "false serves anyway and reports the failed record.",
    )


class DraftModelPolicy(PolicyModel):
    """Speculative decoding: who proposes draft tokens, how many per decode, and when it runs."""

    method: Literal["ngram", "draft"] = Field(
        default="draft",
        description="ngram: prompt lookup (drafts copied from the request's own context, no second model); "
        "draft: a draft model (source) whose tokenizer matches the target's, run for the whole batch with its "
        "own paged KV under the same blocks.",
    )
    source: str | None = Field(
        default=None, min_length=1, max_length=1024,
        description="The draft model: the same forms as the engine's model source (package:, a path, a .gguf, "
        "hf://org/name[@revision]; in a ModelService also pvc://CLAIM/PATH, mounted like the model's), or self:N "
        "(the target's first N layers, final norm and LM head, sharing its weights); required for method draft, "
        "refused for ngram.",
    )
    revision: str | None = Field(default=None, max_length=256,
                                 description="Draft model revision (method draft, hf:// sources only).")
    num_speculative_tokens: int = Field(
        default=4, ge=1, le=16,
        description="Draft tokens proposed per decode step; sets the lookahead when scheduler.maxLookaheadTokens is 0, "
        "else must not exceed it.",
    )
    mode: Literal["on", "off", "auto"] = Field(
        default="auto",
        description="on: always speculate; off: never (the draft stays configured); auto: speculate while the "
        "measured acceptance and step costs say it pays.",
    )
    quantization: Literal["none", "w8a16", "w8a8"] = Field(
        default="none",
        description="The draft model's weights (method draft with a loaded source; CPU only): w8a16 or w8a8 int8 "
        "linears, as the engine's quantization. Not evaluated: a draft's numerics change acceptance, never the "
        "output.",
    )

    @field_validator("mode", mode="before")
    @classmethod
    def _yaml_booleans(cls, v: object) -> object:
        # YAML 1.1 reads a bare `on`/`off` as a boolean; the user meant the mode.
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v

    @model_validator(mode="after")
    def _check_method(self) -> "DraftModelPolicy":
        if self.method == "draft" and not self.source:
            raise ValueError("draftModel.source is required for method draft")
        if self.method == "ngram" and (self.source or self.revision):
            raise ValueError("draftModel.source and draftModel.revision apply to method draft only, not ngram")
        if self.revision and not (self.source or "").startswith("hf://"):
            raise ValueError(f"draftModel.revision applies only to hf:// sources, not {self.source}")
        if self.quantization != "none" and (self.method != "draft" or (self.source or "").startswith("self:")):
            raise ValueError("draftModel.quantization applies to a loaded draft model only, not ngram or self:N "
                             "(which shares the target's weights)")
        return self


class RecordTracePolicy(PolicyModel):
    """Record the live traffic as a simulator trace (JSONL, docs/design.md "Trace (contract)")."""

    path: str = Field(
        min_length=1, max_length=4096,
        description="File the trace is written to (its directory must exist and be writable, e.g. under the model "
        "cache volume $MAGNITUDE_CACHE); rotated files are PATH.1 (newest) to PATH.<keep>.",
    )
    max_bytes: int = Field(
        default=64 * 1024 * 1024, ge=1024, le=1 << 40,
        description="Size at which the file is rotated; a line is never split across files.",
    )
    keep: int = Field(default=3, ge=0, le=1000, description="Rotated files kept besides the current one.")
    include_text: bool = Field(
        default=False, description="Write each request's prompt text (`prompt`); off by default: lengths only.",
    )
    hash_tenants: bool = Field(
        default=True,
        description="Write tenant names as a hash (`t-` and 16 hex digits of their SHA-256), the same name always "
        "the same hash; false writes them as they are.",
    )


def speculation_problem(config: "EngineConfig") -> tuple[str, str] | None:
    """(field, reason) when the draft settings cannot run with this scheduler policy, else None.
    Shared by `magnitude serve` (exit 2) and the operator (Degraded)."""
    d = config.draft_model
    bound = config.scheduler.max_lookahead_tokens
    if d is not None and bound and d.num_speculative_tokens > bound:
        return ("draftModel.numSpeculativeTokens",
                f"{d.num_speculative_tokens} exceeds scheduler.maxLookaheadTokens {bound}")
    return None


class EngineConfig(PolicyModel):
    """The whole engine-facing document: what a ConfigMap, --config file or simulator config holds."""

    scheduler: SchedulerPolicy = Field(default_factory=SchedulerPolicy)
    kv_cache: KVCachePolicy = Field(default_factory=KVCachePolicy)
    admission: AdmissionPolicy = Field(default_factory=AdmissionPolicy)
    tenant_labels: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Tenants given their own metrics label; the rest are reported as `other`.",
    )
    quantization_evaluation: QuantizationEvaluationPolicy = Field(
        default_factory=QuantizationEvaluationPolicy,
        description="What a quantized model's evaluation record must show before it is served.",
    )
    draft_model: DraftModelPolicy | None = Field(
        default=None, description="Speculative decoding (prompt lookup or a draft model); null: none."
    )
    record_trace: RecordTracePolicy | None = Field(
        default=None,
        description="Write the live traffic as a simulator trace (arrival, prompt and output lengths, tenant, class, "
        "cancel time, prefix groups) that `magnitude simulate` replays; null: not recorded.",
    )

    @model_validator(mode="after")
    def _check_swap_space(self) -> "EngineConfig":
        # Refused rather than falling back to recompute on every preemption without a word.
        if self.scheduler.preemption_mode == "swap" and self.kv_cache.swap_blocks == 0:
            raise ValueError("scheduler.preemptionMode swap needs host swap space: kvCache.swapBlocks is 0 "
                             "(set kvCache.swapBlocks, or preemptionMode recompute or auto)")
        return self
