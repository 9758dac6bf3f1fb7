"""The model runner: the only torch/transformers code (loading, paged attention, sampling, swap).

`from magnitude.runner import ModelRunner` is resolved lazily so that importing the package (for
`detokenize`, say) does not pull in torch.
"""

from __future__ import annotations

import os

# Before torch loads libgomp: an idle OpenMP worker spins only briefly (GOMP_SPINCOUNT 1000, a few
# microseconds) and then sleeps. Measured here, 2 threads, 12 decodes + a 48-token chunk
# (`bench/step_profile.py`): on a quiet host fully passive workers cost a KVM wake-up per parallel
# region (fp32 279 ms, int8 254 ms a step) where a short spin gives 176 / 91 ms; with both cores
# busy with other processes the short spin costs 336 / 296 ms against passive's 291 / 172, while
# unbounded spinning (OMP_WAIT_POLICY=ACTIVE) made steps 2-20x slower. Set OMP_WAIT_POLICY or
# GOMP_SPINCOUNT yourself to override (PASSIVE on an oversubscribed host).
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "1000"


# Weight formats `ModelRunner(quantization=...)` applies (runner/quantize.py); here, torch-free, for CLI
# choices. The dtype of everything else (`--dtype`) is a separate setting.
#   w8a8:  int8 weights and per-token int8 activations (torch._int_mm), SmoothQuant-calibrated
#   w8a16: int8 weights, activations in the model's dtype (weight-only)
#   w4a16: 4-bit weights in groups of 32 with scale + min (GGUF Q4_1's layout), int8 LM head;
#          activations fp32 in Magnitude's kernels (runner/lowbit.py), bf16 in torch's fallback
#   w4a8:  w4a16's weights, activations rounded to int8 per group of 32 (Magnitude's kernels only)
#   w4a16-int16: w4a16's weights, activations rounded to int16 per group of 32 (Magnitude's kernels only)
#   w4a16-bf16prefill: w4a16's weights; decodes as w4a16, prompt-chunk rows multiplied in bf16
#          (Magnitude's kernels on a CPU with AVX512-BF16 only)
#   int8:  the earlier name of w8a8, still accepted so existing specs keep loading
QUANTIZATIONS = ("none", "w8a8", "w8a16", "w4a16", "w4a8", "w4a16-int16", "w4a16-bf16prefill", "int8")
QUANTIZATION_ALIASES = {"int8": "w8a8"}


def canonical_quantization(name: str | None) -> str:
    """The method a quantization name means ("int8" -> "w8a8"; None -> "none"); unknown names pass
    through for the caller's check to refuse by name."""
    q = name or "none"
    return QUANTIZATION_ALIASES.get(q, q)


def __getattr__(name: str):
    if name in ("ModelRunner", "DraftProposer", "StepTiming"):
        from magnitude.runner import runner

        return getattr(runner, name)
    raise AttributeError(name)
