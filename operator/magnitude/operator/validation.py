"""Spec combinations the schema allows but the engine cannot serve (yet): refused, never ignored.

Each `Problem` names the field so the `Degraded` condition and the Warning event point at it.
The CRD's OpenAPI and CEL rules already refuse malformed specs at the API server; this covers
what depends on the engine's capabilities and the hardware asked for. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from magnitude.operator.spec import ModelServiceSpec

# What `magnitude serve` can load today. Widen these as the runner learns more.
ENGINE_QUANTIZATIONS = frozenset({"none", "bf16", "int8"})
ENGINE_LOADS_DRAFT_MODELS = False
GPU_ONLY_QUANTIZATIONS = frozenset({"fp8"})
# The engine's int8 path is W8A8 through torch._int_mm, validated on CPU only (runner/quantize.py).
CPU_ONLY_QUANTIZATIONS = frozenset({"int8"})


@dataclass(frozen=True)
class Problem:
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def unsupported(spec: ModelServiceSpec) -> list[Problem]:
    """Every reason the operator will not roll this spec out; empty when it is servable."""
    problems: list[Problem] = []
    if spec.quantization in GPU_ONLY_QUANTIZATIONS and spec.resources.gpus == 0:
        problems.append(Problem("spec.quantization",
                                f"{spec.quantization} needs spec.resources.gpus >= 1 (no {spec.quantization} kernels on CPU)"))
    elif spec.quantization in CPU_ONLY_QUANTIZATIONS and spec.resources.gpus > 0:
        problems.append(Problem("spec.quantization",
                                f"the engine's {spec.quantization} weights run on the CPU only; "
                                "use bf16 with spec.resources.gpus >= 1, or set gpus to 0"))
    elif spec.quantization not in ENGINE_QUANTIZATIONS:
        problems.append(Problem("spec.quantization",
                                f"the engine cannot load {spec.quantization} weights yet "
                                f"(supported: {', '.join(sorted(ENGINE_QUANTIZATIONS))})"))
    if spec.draft_model is not None:
        if not ENGINE_LOADS_DRAFT_MODELS:
            problems.append(Problem("spec.draftModel",
                                    "the engine cannot load a draft model yet (`magnitude serve` has no draft loader)"))
        if spec.draft_model.num_speculative_tokens > spec.scheduler.max_lookahead_tokens:
            problems.append(Problem("spec.draftModel.numSpeculativeTokens",
                                    f"{spec.draft_model.num_speculative_tokens} exceeds "
                                    f"spec.scheduler.maxLookaheadTokens {spec.scheduler.max_lookahead_tokens}"))
    sp = spec.scheduler
    if sp.prefill_chunk_size is None and sp.itl_target_ms is not None:
        problems.append(Problem("spec.scheduler.itlTargetMs",
                                "deriving prefillChunkSize needs a cost model measured on the serving hardware, "
                                "which engine pods do not carry yet: set spec.scheduler.prefillChunkSize "
                                "(`magnitude profile --itl-target` prints it)"))
    return problems
