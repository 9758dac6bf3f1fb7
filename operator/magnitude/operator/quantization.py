"""The quantization evaluation records engine pods report, judged into the `QuantizationValidated`
condition. Pure: no I/O (the scraper reads `/readyz`; status.py writes the condition).

An engine that loads quantized weights evaluates them against its unquantized reference before it
becomes ready and reports the record on `/readyz` (200 or 503) as `quantization: {method, passed,
enforced, failures, top1_agreement, mean_kl, probes_passed, probes_total, isa, ...}`; below the
thresholds of `spec.quantizationEvaluation` with `enforce` it stays not ready in phase
`quantization_rejected`. The engine judges, the operator reports: every pod of a service loads the
same weights, but pods may land on CPUs with different kernels (ISA), so one rejected pod is
enough to reject and the message names it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# /readyz phases (server/magnitude/server/async_engine.py `not_ready_reason`).
PHASE_REJECTED = "quantization_rejected"

# QuantizationValidated reasons.
PASSED = "Passed"
REJECTED = "Rejected"
FAILED_NOT_ENFORCED = "FailedNotEnforced"
PENDING = "Pending"


@dataclass(frozen=True)
class Record:
    """The part of an engine's evaluation record the operator shows."""

    method: str
    passed: bool
    enforced: bool
    failures: tuple[str, ...]
    top1_agreement: float
    mean_kl: float
    probes_passed: int
    probes_total: int
    isa: str

    def figures(self) -> str:
        return (f"{self.method}: top-1 agreement {self.top1_agreement:.3f}, mean KL {self.mean_kl:.4f}, "
                f"probes {self.probes_passed}/{self.probes_total}, ISA {self.isa}")


def parse_record(raw: Any) -> Record | None:
    """A record from the `quantization` object of `/readyz`, or None when it is missing or not
    shaped like one (a pod is not trusted to send sane JSON: a bad record counts as none yet)."""
    if not isinstance(raw, dict):
        return None
    try:
        numbers = (float(raw["top1_agreement"]), float(raw["mean_kl"]))
        probes = (int(raw["probes_passed"]), int(raw["probes_total"]))
        method, passed, enforced = raw["method"], raw["passed"], raw.get("enforced", True)
        failures = raw.get("failures") or []
    except (KeyError, TypeError, ValueError, OverflowError):
        return None
    if not (isinstance(method, str) and isinstance(passed, bool) and isinstance(enforced, bool)
            and isinstance(failures, list) and all(math.isfinite(x) for x in numbers)):
        return None
    return Record(method=method[:64], passed=passed, enforced=enforced,
                  failures=tuple(str(f)[:300] for f in failures[:8]), top1_agreement=numbers[0], mean_kl=numbers[1],
                  probes_passed=probes[0], probes_total=probes[1], isa=str(raw.get("isa", "unknown"))[:64])


@dataclass(frozen=True)
class PodReport:
    """What one pod's `/readyz` said: its phase (None when ready or unknown) and its record."""

    pod: str
    phase: str | None = None
    record: Record | None = None
    source: str | None = None  # where the served weights came from (a ready pod's /readyz)
    revision: str | None = None  # hf:// sources: the commit SHA they were pinned to
    bytes_done: int | None = None  # phase downloading: bytes on disk so far
    bytes_total: int | None = None  # phase downloading: bytes the download will have
    # What its scheduler runs with (a ready pod's /readyz `scheduler`): (tokenBudget, prefillChunkSize,
    # itlTargetMs or None, source).
    scheduler: tuple[int, int, float | None, str] | None = None


@dataclass(frozen=True)
class Verdict:
    """The `QuantizationValidated` condition, and what `Degraded` must say (None: nothing)."""

    status: str  # "True", "False", "Unknown"
    reason: str
    message: str
    degraded: str | None = None


def _pods(reports: Sequence[PodReport]) -> str:
    return ", ".join(r.pod for r in reports)


def judge(reports: Sequence[PodReport]) -> Verdict:
    """The condition over the pods' records: any pod rejected -> Rejected; else any failed record
    served anyway (enforce false) -> FailedNotEnforced; else any record -> Passed; none -> Pending."""
    rejected = [r for r in reports if r.phase == PHASE_REJECTED]
    if rejected:
        first = rejected[0].record
        detail = (f"{first.figures()}; failed {'; '.join(first.failures) or 'its thresholds'}" if first
                  else "no record in its answer")
        message = (f"pod(s) {_pods(rejected)} refused to serve the quantized weights: {detail} "
                   "(spec.quantizationEvaluation; enforce: false serves anyway)")
        return Verdict("False", REJECTED, message, degraded=message)
    recorded = [r for r in reports if r.record is not None]
    failed = [r for r in recorded if not r.record.passed]  # type: ignore[union-attr]
    if failed:
        rec = failed[0].record
        assert rec is not None
        return Verdict("False", FAILED_NOT_ENFORCED,
                       f"pod(s) {_pods(failed)} serve weights that failed their evaluation because "
                       f"spec.quantizationEvaluation.enforce is false: {rec.figures()}; failed "
                       f"{'; '.join(rec.failures) or 'its thresholds'}")
    if recorded:
        rec = recorded[0].record
        assert rec is not None
        others = {r.record.figures() for r in recorded} - {rec.figures()}  # type: ignore[union-attr]
        return Verdict("True", PASSED, f"{len(recorded)} pod(s) passed: {rec.figures()}"
                       + (f" (also: {'; '.join(sorted(others))})" if others else ""))
    return Verdict("Unknown", PENDING, "no pod has reported an evaluation record yet")
