"""The engine's default weights per device: which dtype and quantization `magnitude serve` runs when
`--dtype` / `--quantization` are left at `auto`, and the reason, which the serve log and `/readyz`
report (issue 17 owns this rule; docs/runner.md "Default weights per CPU" has the measurements).

- CUDA: bfloat16, no quantization (the low-bit kernels here are CPU-only).
- A CPU with AVX512-BF16 (AMX CPUs have it too) serving a GGUF whose decoder linears are Q4_1 (the
  bundled model), where Magnitude's kernels are built with its bf16 products: fp32 with
  w4a16-bf16prefill linears. Decodes run exactly as w4a16's (below); prompt chunks multiply in bf16,
  prefill steps of 64 tokens 2.3x as fast as w4a16's, for a record of top-1 0.992 and mean KL 1e-4
  against fp32 (2-core AVX-512 BF16 EPYC, docs/runner.md). Its record failing, w4a16.
- An AVX2 CPU without AVX-512 serving such a GGUF: fp32 with w4a16-int16 linears, where Magnitude's
  kernels are built: w4a16's codes and prompt chunks' decoder products, decode rows' activations
  (and the LM head's rows) rounded to int16 with integer dot products: with the head still fp32, a
  lone decode step 0.69-0.76x w4a16's time, 8 decodes 0.95-0.96x, 24 1.13x (prompt chunks the
  same); the int16 head took another 0.91-0.98x of 1-8-decode steps. One stream served at
  0.82-1.04x llama-server's time a token, for a record of top-1 1.000 and mean KL 5e-7 (2-core AVX2
  EPYC, docs/runner.md). Its record failing, w4a16.
- Any other CPU serving such a GGUF: fp32 with w4a16 linears. Their codes are the file's exactly
  (runner/quantize.py), so the weights lose nothing, and a decode step reads about 6x fewer weight
  bytes than in fp32. bf16 weights would prefill faster but decode 3.7-6.2x slower (batch 1 to 8),
  and a served stream waits on decodes. (The int16 products are AVX2 code; on AVX-512 the fp32
  passes win from 4 rows on: w4a16-int16's decode steps of 1, 4, 8 and 24 rows took 0.95x, 1.14x,
  1.33x and 1.64x w4a16-bf16prefill's time, w4a16's 0.92-1.01x, on a 2-core AMX Xeon,
  bench/results/runner_llama.md S61.)
- Any other checkpoint on a CPU with native bf16 matmuls (AMX-BF16 or AVX512-BF16 in
  /proc/cpuinfo): bfloat16 weights, no quantization: bf16 steps there run 1.1-2.7x as fast as fp32's
  and keep the KV cache in fp32.
- Any other checkpoint on any other CPU (AVX2, AVX-512 without BF16): fp32, exact to the file;
  bf16 has no native matmul there.

The quantized choice is gated by its evaluation record: when the record fails the config's
thresholds, `magnitude serve` reloads with `fallback()` (w4a16 after w4a16-bf16prefill or
w4a16-int16, else fp32 with no quantization), judges again, and says so, rather than
refusing to serve as it does for a quantization asked for by name. An explicit dtype or
quantization is used as given (`--dtype float32 --quantization none` is the exact reference).

The KV pool's dtype (`kvCache.dtype`, `choose_kv_cache_dtype`) follows the weights: float16 beside
w4a16, w4a8, w4a16-int16 or w4a16-bf16prefill weights on the CPU (FLOAT16_KV_QUANTIZATIONS), float32 beside any
other, the model's dtype on CUDA.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
BF16_PRODUCT_FLAG = "avx512_bf16"  # VDPBF16PS: w4a16-bf16prefill's prompt products (AMX CPUs list it too)
INT16_PRODUCT_FLAG = "avx2"  # VPMADDWD on 256 bits: w4a16-int16's decode products


@dataclass(frozen=True, slots=True)
class WeightsChoice:
    """The dtype and quantization a runner loads with, and how they were decided."""

    dtype: str | None  # None: the loader's own default for the device (float32 CPU, bfloat16 CUDA)
    quantization: str
    chosen_by: str  # "flags" (given) | "default" (this module's rule) | "fallback" (the record failed)
    reason: str

    def to_document(self) -> dict[str, str | None]:
        return asdict(self)


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags (Linux); empty where /proc/cpuinfo cannot be read."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def q4_1_gguf(path: Path | None) -> bool:
    """Whether `path` is a GGUF whose decoder linears (blk.N.attn_*/ffn_* matrices) are all Q4_1."""
    if path is None or path.suffix != ".gguf" or not path.is_file():
        return False
    from gguf import GGUFReader

    types = {t.tensor_type.name for t in GGUFReader(str(path)).tensors
             if t.name.startswith("blk.") and len(t.shape) == 2 and (".attn_" in t.name or ".ffn_" in t.name)}
    return types == {"Q4_1"}


def choose_weights(dtype: str | None, quantization: str | None, device_type: str, q4_1_source: bool,
                   flags: frozenset[str] | None = None, bf16_kernels: bool | None = None,
                   int16_kernels: bool | None = None) -> WeightsChoice:
    """The weights to load. Either flag given (not None/"auto") decides, the other taking the
    loader's plain default (no quantization; float32 on CPU); both unset: the rule above.
    `q4_1_source`: the checkpoint's decoder linears are Q4_1 (`q4_1_gguf`). `flags`: the CPU's
    feature flags (default: this machine's). `bf16_kernels`: whether Magnitude's kernels built here
    have the bf16 products (`lowbit.kernels().bf16`; None: assume so where the flags have avx512_bf16).
    `int16_kernels`: whether Magnitude's kernels are in use here and built for AVX2 (`lowbit.kernels()`
    not None and its `isa` "avx2"; None: assume so), which w4a16-int16 needs."""
    dtype = None if dtype in (None, "", "auto") else dtype
    quantization = None if quantization in (None, "", "auto") else quantization
    if dtype is not None or quantization is not None:
        return WeightsChoice(dtype, quantization or "none", "flags", "as given")
    if device_type != "cpu":
        return WeightsChoice(None, "none", "default",
                             f"{device_type}: bfloat16, no quantization (the low-bit kernels are CPU-only)")
    flags = cpu_flags() if flags is None else flags
    if q4_1_source and BF16_PRODUCT_FLAG in flags and bf16_kernels is not False:
        return WeightsChoice("float32", "w4a16-bf16prefill", "default",
                             f"CPU with {BF16_PRODUCT_FLAG}, Q4_1 checkpoint: w4a16's exact 4-bit codes, decodes as "
                             "w4a16, prompt chunks multiplied in bf16 (2.3x faster prefill steps); gated by the "
                             "evaluation record")
    if q4_1_source and INT16_PRODUCT_FLAG in flags and "avx512f" not in flags and int16_kernels is not False:
        return WeightsChoice("float32", "w4a16-int16", "default",
                             f"CPU with {INT16_PRODUCT_FLAG} (no AVX-512), Q4_1 checkpoint: w4a16's exact 4-bit codes "
                             "and prompt chunks, decodes' activations and the LM head's rows rounded to int16 with "
                             "integer dot products (a lone decode step 0.69-0.76x w4a16's time); gated by the "
                             "evaluation record")
    if q4_1_source:
        return WeightsChoice("float32", "w4a16", "default",
                             "CPU, Q4_1 checkpoint: w4a16 keeps its 4-bit codes exactly and reads ~6x fewer "
                             "weight bytes per decode step than float32 (decodes faster than bfloat16 even "
                             "where bf16 is native); gated by the evaluation record")
    native = [f for f in NATIVE_BF16_FLAGS if f in flags]
    if native:
        return WeightsChoice("bfloat16", "none", "default",
                             f"CPU with native bf16 matmuls ({', '.join(native)}), checkpoint not Q4_1: "
                             "bfloat16 weights")
    return WeightsChoice("float32", "none", "default",
                         "CPU without native bf16 (no amx_bf16/avx512_bf16), checkpoint not Q4_1: float32, "
                         "exact to the file")


KV_CACHE_DTYPES = ("auto", "float32", "float16")
FLOAT16_KV_QUANTIZATIONS = ("w4a16", "w4a8", "w4a16-int16", "w4a16-bf16prefill")  # auto's float16 pool: the weights the fused C step runs


def choose_kv_cache_dtype(requested: str, device_type: str, quantization: str, model_dtype: str) -> tuple[str, str]:
    """(dtype, reason) of the KV pool for `kvCache.dtype`: as given, or for `auto`
    - CPU, FLOAT16_KV_QUANTIZATIONS weights (the fused C step's, which reads halves as it attends): float16,
      half the bytes a token costs in memory and in a decode's attention reads; attention still
      sums in fp32. The quantization's evaluation record measures the model with this pool against
      the fp32 reference, so the record that gates a default quantization gates this too;
    - CPU, any other weights: float32. Unquantized, it is the exact reference (a bf16 model's too:
      torch's SDPA on the CPU is slower in bf16, and its K/V then lose nothing); w8a16 and w8a8 run
      torch's attention, which would convert every gathered K/V to fp32 (float16 is not measured
      for them: set it by name);
    - CUDA: the model's dtype."""
    if requested not in KV_CACHE_DTYPES:
        raise ValueError(f"kvCache.dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {requested!r}")
    if requested != "auto":
        return requested, "kvCache.dtype"
    if device_type != "cpu":
        return model_dtype, f"{device_type}: the model's dtype"
    if quantization in FLOAT16_KV_QUANTIZATIONS:
        return "float16", f"CPU, {quantization} weights: float16 K/V, judged with them by the evaluation record"
    if quantization != "none":
        return "float32", f"CPU, {quantization} weights: float32 K/V (float16 is measured beside {', '.join(FLOAT16_KV_QUANTIZATIONS)} only)"
    return "float32", "CPU, unquantized weights: float32 K/V, exact"


def fallback(choice: WeightsChoice, failures: list[str]) -> WeightsChoice:
    """What a default quantized choice falls back to when its evaluation record fails: w4a16 after
    w4a16-bf16prefill or w4a16-int16 (judged in turn), else the exact float32."""
    if choice.quantization in ("w4a16-bf16prefill", "w4a16-int16"):
        return WeightsChoice("float32", "w4a16", "fallback",
                             f"{choice.quantization} failed its evaluation record ({'; '.join(failures)}): w4a16")
    return WeightsChoice("float32", "none", "fallback",
                         f"{choice.quantization} failed its evaluation record ({'; '.join(failures)}): float32")
