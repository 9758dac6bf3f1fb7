"""Spec combinations the schema allows but the engine cannot serve (yet): refused, never ignored.

Each `Problem` names the field so the `Degraded` condition and the Warning event point at it.
The CRD's OpenAPI and CEL rules already refuse malformed specs at the API server; this covers
what depends on the engine's capabilities and the hardware asked for. Pure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from magnitude.operator.spec import PVC_SCHEME, PVC_SOURCE, ModelServiceSpec
from magnitude.policy.schema import speculation_problem

# What `magnitude serve --quantization` can load today. Widen these as the runner learns more.
ENGINE_QUANTIZATIONS = frozenset({"none", "w8a8", "w8a16", "w4a16", "w4a8", "w4a16-int16", "w4a16-bf16prefill", "int8"})
# The engine's low-bit kernels (its own C kernels for w4a16, w4a8, w4a16-int16, w4a16-bf16prefill and w8a16, else torch's; torch._int_mm
# for w8a8) are validated on the CPU only (runner/quantize.py); `magnitude serve` refuses them on cuda.
CPU_ONLY_QUANTIZATIONS = frozenset({"w8a8", "w8a16", "w4a16", "w4a8", "w4a16-int16", "w4a16-bf16prefill", "int8"})


# `magnitude serve` flags that spec.auth sets through the environment: the same flag in extraArgs
# would win over it without a word (a flag beats its environment variable).
AUTH_FLAGS = ("--auth-mode", "--api-keys-file")
API_KEY_FLAG = "--api-key"
# Set from spec.metrics.compat: in extraArgs it would silently win over the spec.
METRICS_COMPAT_FLAG = "--metrics-compat"
# `magnitude serve` flags the operator sets from the spec's model fields and engine config: given
# again in extraArgs, argparse's last value (or the flag over its environment variable) would win
# over the spec without a word.
SPEC_FLAGS = {
    "--model": "spec.model.source",
    "--revision": "spec.model.revision",
    "--served-model-name": "spec.model.servedModelName",
    "--config": "the spec's engine policy (scheduler, kvCache, admission)",
    "--set": "the spec's engine policy (scheduler, kvCache, admission)",
}


@dataclass(frozen=True)
class Problem:
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def unsupported(spec: ModelServiceSpec) -> list[Problem]:
    """Every reason the operator will not roll this spec out; empty when it is servable."""
    problems: list[Problem] = []
    if spec.quantization in CPU_ONLY_QUANTIZATIONS and spec.resources.gpus > 0:
        problems.append(Problem("spec.quantization",
                                f"the engine's {spec.quantization} weights run on the CPU only (no int8 GPU "
                                "kernels); use quantization none with dtype bfloat16 on GPUs, or set "
                                "spec.resources.gpus to 0"))
    elif spec.quantization not in ENGINE_QUANTIZATIONS:  # the CRD's enum is wider than the engine
        problems.append(Problem("spec.quantization",
                                f"the engine cannot load {spec.quantization} weights yet "
                                f"(supported: {', '.join(sorted(ENGINE_QUANTIZATIONS))})"))
    if spec.draft_model is not None and spec.draft_model.quantization != "none" and spec.resources.gpus > 0:
        problems.append(Problem("spec.draftModel.quantization",
                                f"the engine's {spec.draft_model.quantization} weights run on the CPU only; use "
                                "quantization none for a draft on GPUs"))
    draft_source = spec.draft_model.source or "" if spec.draft_model is not None else ""
    if draft_source.startswith(PVC_SCHEME) and not re.match(PVC_SOURCE, draft_source):
        problems.append(Problem("spec.draftModel.source",
                                f"{draft_source} is not pvc://CLAIM/PATH (CLAIM the name of a PersistentVolumeClaim)"))
    spec_problem = speculation_problem(spec)
    if spec_problem is not None:
        problems.append(Problem(f"spec.{spec_problem[0]}", spec_problem[1]))
    problems += _auth_problems(spec)
    for flag, field in SPEC_FLAGS.items():
        if any(_names_flag(a, flag) for a in spec.extra_args):
            problems.append(Problem("spec.extraArgs", f"{flag} would override {field} without a word; set it there"))
    if any(_names_flag(a, METRICS_COMPAT_FLAG) for a in spec.extra_args):
        problems.append(Problem("spec.extraArgs",
                                f"{METRICS_COMPAT_FLAG} would override spec.metrics.compat without a word; "
                                "set spec.metrics.compat instead"))
    # scheduler.itlTargetMs is accepted: engine pods calibrate their cost model at start-up (or read
    # it from the model cache), derive what is null and report it; status.scheduler shows it.
    return problems


def _names_flag(arg: str, flag: str) -> bool:
    """Whether an extraArgs entry sets `flag`: `--flag`, `--flag=v`, or an abbreviation argparse
    would accept (`--auth` for `--auth-mode`), except the exact name of another flag."""
    given = arg.split("=", 1)[0]
    if given == flag:
        return True
    exact = (*AUTH_FLAGS, API_KEY_FLAG, METRICS_COMPAT_FLAG, *SPEC_FLAGS)
    return len(given) > 2 and given.startswith("--") and flag.startswith(given) and given not in exact


def _auth_problems(spec: ModelServiceSpec) -> list[Problem]:
    problems: list[Problem] = []
    for flag in AUTH_FLAGS:
        if any(_names_flag(a, flag) for a in spec.extra_args):
            problems.append(Problem("spec.extraArgs",
                                    f"{flag} would override spec.auth without a word; set spec.auth instead"))
    if spec.auth.mode == "apiKeys" and any(_names_flag(a, API_KEY_FLAG) for a in spec.extra_args):
        problems.append(Problem("spec.extraArgs",
                                f"{API_KEY_FLAG} cannot be combined with spec.auth.mode apiKeys (the engine refuses "
                                "to start): every key in the keys Secret already authenticates its tenant"))
    return problems
