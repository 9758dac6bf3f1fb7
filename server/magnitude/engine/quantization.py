"""The quantization evaluation record and its verdict (pure: no torch, no I/O).

A quantized model is a release candidate with its own evaluation record: the runner measures it
against its unquantized reference at load (`runner/quant_eval.py`) and fills a
`QuantizationRecord`; `judge` compares the figures with the `quantizationEvaluation` thresholds of
the engine config. The record holds figures only, so a cached record is re-judged when the
thresholds change. The same dict form is logged, shown in `/v1/models` and `/readyz`, and read
by the operator.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from magnitude.policy.schema import QuantizationEvaluationPolicy


@dataclass(slots=True)
class ProbeResult:
    """One behaviour probe: the reference's and the quantized model's greedy answers."""

    name: str
    reference: str
    output: str
    reference_passed: bool  # a probe the reference itself fails says nothing: it is not counted
    passed: bool


@dataclass(slots=True)
class QuantizationRecord:
    method: str  # w8a8 | w8a16
    dtype: str
    top1_agreement: float  # teacher-forced, over the evaluation text
    mean_kl: float  # KL(reference || quantized) in nats per token, same positions
    eval_tokens: int
    probes: list[ProbeResult]
    eval_set_hash: str
    isa: str  # the CPU kernels the figures were measured with (torch's capability + CPU flags)
    torch_version: str
    seconds: float  # how long the evaluation took
    kv_cache_dtype: str = "float32"  # the KV pool the quantized side ran over (the reference's: float32)
    cached: bool = False  # read back from the cache instead of measured by this process
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def probes_total(self) -> int:
        return sum(1 for p in self.probes if p.reference_passed)

    @property
    def probes_passed(self) -> int:
        return sum(1 for p in self.probes if p.reference_passed and p.passed)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["probes_passed"], d["probes_total"] = self.probes_passed, self.probes_total
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "QuantizationRecord":
        names = set(cls.__dataclass_fields__)
        kw = {k: v for k, v in d.items() if k in names}
        kw["probes"] = [ProbeResult(**p) for p in d.get("probes", [])]
        return cls(**kw)


@dataclass(slots=True)
class Verdict:
    passed: bool
    failures: list[str]  # which threshold each failed figure missed, for logs and conditions
    enforced: bool

    @property
    def serve(self) -> bool:
        """Whether the engine serves these weights: it does when they pass or when enforce is off."""
        return self.passed or not self.enforced


def judge(record: QuantizationRecord, policy: QuantizationEvaluationPolicy) -> Verdict:
    failures: list[str] = []
    if record.top1_agreement < policy.min_top1_agreement:
        failures.append(f"top-1 agreement {record.top1_agreement:.3f} < minTop1Agreement {policy.min_top1_agreement}")
    if record.mean_kl > policy.max_mean_kl:
        failures.append(f"mean KL {record.mean_kl:.4f} > maxMeanKl {policy.max_mean_kl}")
    need = record.probes_total if policy.min_probes_passed is None else min(policy.min_probes_passed, record.probes_total)
    if record.probes_passed < need:
        failed = [p.name for p in record.probes if p.reference_passed and not p.passed]
        failures.append(f"probes passed {record.probes_passed}/{record.probes_total} < {need} (failed: {', '.join(failed)})")
    return Verdict(not failures, failures, policy.enforce)


def summary(record: QuantizationRecord, verdict: Verdict) -> dict[str, Any]:
    """What `/v1/models`, `/readyz` and the operator show: the figures, the verdict, the context."""
    return {
        "method": record.method,
        "passed": verdict.passed,
        "enforced": verdict.enforced,
        "failures": verdict.failures,
        "top1_agreement": round(record.top1_agreement, 4),
        "mean_kl": round(record.mean_kl, 5),
        "probes_passed": record.probes_passed,
        "probes_total": record.probes_total,
        "probes": [{"name": p.name, "passed": p.passed, "reference_passed": p.reference_passed} for p in record.probes],
        "eval_tokens": record.eval_tokens,
        "eval_set_hash": record.eval_set_hash,
        "isa": record.isa,
        "torch_version": record.torch_version,
        "dtype": record.dtype,
        "kv_cache_dtype": record.kv_cache_dtype,
        "cached": record.cached,
    }
