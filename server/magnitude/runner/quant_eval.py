"""The quantization evaluation: a quantized model measured against its unquantized reference.

Owns the fixed evaluation set (held-out text and behaviour probes, shipped here and hashed), the
measurement, and the cache of records. At load, before the engine becomes ready:
1. the reference (the same model before `quantize_linears` replaces its linears) is measured
   through the paged runner: log-probabilities over `EVAL_TEXT` (chunked prefill over the KV
   pool), greedy answers to `PROBES` (decoded together, as a batch is served);
2. the quantized model is measured the same way, the path users get;
3. top-1 agreement and mean KL(reference || quantized) over the same positions, and each probe's
   check on both answers, make a `QuantizationRecord` (engine/quantization.py), which is judged
   against the config's thresholds by the engine.
The reference runs over an fp32 KV pool and the quantized model over the pool it is served with
(a float16 one by default on the CPU, runner/defaults.py), so the record judges both together.
A record is cached by model, revision, method, dtype, KV dtype, ISA, torch version and evaluation-set hash,
so a restarted pod (a startup probe's restart included) does not evaluate again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from magnitude.engine.quantization import ProbeResult, QuantizationRecord
from magnitude.runner.quantize import int8_kernel

if TYPE_CHECKING:
    from magnitude.runner.runner import ModelRunner

log = logging.getLogger(__name__)

# Held-out text: not the calibration text, not the tests' prompts. Prose, dialogue, code, numbers.
EVAL_TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at six, carrying a tin of oil and a "
    "cloth for the lens. From the gallery he could see the fishing boats returning, their lamps bobbing "
    "on the dark water like fireflies. In winter the storms came from the north-east, and the waves broke "
    "so high that spray reached the lantern room. \"Will the ships be safe tonight?\" his daughter asked. "
    "\"As long as the light turns,\" he said. Photosynthesis converts light energy into chemical energy: "
    "plants take in carbon dioxide and water and release oxygen and glucose. The mitochondria then turn "
    "glucose into ATP. def mean(values):\n    total = sum(values)\n    return total / len(values)\n"
    "print(mean([3, 5, 10]))  # prints 6.0\nThe train left Lisbon at 08:15 and arrived in Porto at 11:02, "
    "a journey of 2 hours and 47 minutes over 337 kilometres. A recipe for pancakes needs 200 g of flour, "
    "2 eggs and 300 ml of milk; whisk until smooth and rest the batter for ten minutes."
)

_FILLER = (
    "The village market opens at dawn. Farmers bring apples, pears and cabbages from the hills, and the "
    "baker sells bread still warm from the oven. Children chase pigeons across the square while their "
    "parents talk about the weather and the price of wool. "
)


@dataclass(frozen=True, slots=True)
class Probe:
    """A chat question and how to check an answer: it contains `expect`, or parses as a JSON object
    with `json_keys`."""

    name: str
    question: str
    expect: str | None = None
    json_keys: tuple[str, ...] = ()

    def check(self, answer: str) -> bool:
        if self.json_keys:
            m = re.search(r"\{.*\}", answer, re.S)
            try:
                obj = json.loads(m.group(0)) if m else None
            except ValueError:
                return False
            return isinstance(obj, dict) and all(k in obj for k in self.json_keys)
        return self.expect is not None and self.expect.lower() in answer.lower()


PROBES = (
    Probe("factual", "What is the capital of France?", expect="Paris"),
    Probe("json", 'Reply with only a JSON object with the keys "name" and "age" for a person named Alice '
          "who is 30 years old.", json_keys=("name", "age")),
    Probe("arithmetic", "What is 7 plus 5? Answer with the number only.", expect="12"),
    Probe("long_context_recall", "Remember this: the secret code is 4817. " + _FILLER * 4 + "What is the secret code?",
          expect="4817"),
)
PROBE_MAX_TOKENS = 24
KL_ROWS = 32  # positions whose KL is computed together (agreement_and_kl)
SCORE_CHUNK = 64  # the evaluation text is prefilled in chunks: later chunks attend through the pool

EVAL_SET_HASH = hashlib.sha256(json.dumps(
    {"text": EVAL_TEXT, "probes": [[p.name, p.question, p.expect, list(p.json_keys)] for p in PROBES],
     "max_tokens": PROBE_MAX_TOKENS, "chunk": SCORE_CHUNK}, sort_keys=True).encode()).hexdigest()[:16]

_ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def isa_description() -> str:
    """torch's CPU kernel level and the CPU flags that pick int8/bf16 kernels, e.g.
    'AVX2 (avx2)' or 'AVX512 (avx2 avx512f avx512_vnni amx_tile amx_int8 amx_bf16)'."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    present = " ".join(fl for fl in _ISA_FLAGS if fl in flags)
    level = torch.backends.cpu.get_cpu_capability()
    forced = [f"{k}={os.environ[k]}" for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if os.environ.get(k)]
    return f"{level} ({present or 'no SIMD flags read'})" + (f" [{' '.join(forced)}]" if forced else "")


LOWBIT_METHODS = ("w4a16", "w4a8", "w4a16-int16", "w4a16-bf16prefill", "w8a16")


def kernel_description(method: str) -> str:
    """`isa_description()` plus, for the weight-only methods, which low-bit kernels they run on
    (runner/lowbit.py: Magnitude's build for this CPU, or torch's): their numerics and speed differ.
    Whether the bf16 products run on AMX tiles is named for w4a16-bf16prefill only, the one method
    that runs them."""
    if method not in LOWBIT_METHODS:
        return isa_description()
    from magnitude.runner import lowbit

    return f"{isa_description()} lowbit={lowbit.describe(bf16_products=method == 'w4a16-bf16prefill')}"


@dataclass(slots=True)
class Measurement:
    """What one model does on the evaluation set, through the paged runner."""

    log_probs: torch.Tensor  # [T, vocab] over EVAL_TEXT, float32
    answers: list[list[int]]  # greedy answer to each probe, EOS cut off


def probe_prompt_ids(tokenizer: Any, probe: Probe) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": probe.question}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def blocks_needed(tokenizer: Any, block_size: int) -> int:
    """The KV blocks `measure` writes (from the pool's first): the evaluation text's, then every
    probe's prompt and answer at once."""
    text = -(-len(tokenizer(EVAL_TEXT)["input_ids"]) // block_size)
    probes = sum(-(-(len(probe_prompt_ids(tokenizer, p)) + PROBE_MAX_TOKENS) // block_size) for p in PROBES)
    return max(text, probes)


def measure(runner: "ModelRunner") -> Measurement:
    """Run the evaluation set through the runner as it serves: chunked prefill over the KV pool, and
    the probes decoded together as one batch. Called twice at load: on the unquantized model (the
    reference, over an fp32 KV pool), then on the quantized one over the pool it is served with, so
    both sides are the same computation but the weights and the KV cache's dtype."""
    text_ids = runner.tokenizer(EVAL_TEXT)["input_ids"]
    log_probs = runner.score_tokens(text_ids, SCORE_CHUNK)
    answers = runner.greedy_tokens([probe_prompt_ids(runner.tokenizer, p) for p in PROBES], PROBE_MAX_TOKENS)
    return Measurement(log_probs, [_cut_at(a, runner.eos_token_ids) for a in answers])


def _cut_at(tokens: list[int], eos: list[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i]
    return tokens


def agreement_and_kl(reference: torch.Tensor, quantized: torch.Tensor) -> tuple[float, float]:
    """Top-1 agreement and mean KL(reference || quantized) of two [T, vocab] log-probability rows.
    Each row's KL is taken KL_ROWS rows at a time: the whole [T, vocab] temporaries at once (SmolLM2:
    three of 46 MiB) were a first start's peak."""
    agree = (reference.argmax(-1) == quantized.argmax(-1)).float().mean().item()
    per_row = torch.cat([(r.exp() * (r - q)).sum(-1)
                         for r, q in zip(reference.split(KL_ROWS), quantized.split(KL_ROWS))])
    return agree, max(0.0, per_row.mean().item())


def make_record(runner: "ModelRunner", ref: Measurement, got: Measurement, method: str,
                started: float) -> QuantizationRecord:
    agree, kl = agreement_and_kl(ref.log_probs, got.log_probs)
    probes = []
    for probe, ref_answer, answer in zip(PROBES, ref.answers, got.answers):
        ref_text = runner.tokenizer.decode(ref_answer, skip_special_tokens=True)
        text = runner.tokenizer.decode(answer, skip_special_tokens=True)
        probes.append(ProbeResult(probe.name, ref_text, text, probe.check(ref_text), probe.check(text)))
    return QuantizationRecord(
        method=method, dtype=str(runner.dtype).removeprefix("torch."),
        kv_cache_dtype=str(runner.kv.shape.dtype).removeprefix("torch."), top1_agreement=agree, mean_kl=kl,
        eval_tokens=int(ref.log_probs.shape[0]), probes=probes, eval_set_hash=EVAL_SET_HASH, isa=kernel_description(method),
        torch_version=torch.__version__, seconds=time.perf_counter() - started,
        extra={"int8_kernel": int8_kernel()} if method == "w8a8" else {},
    )


def cache_key(*parts: str) -> str:
    """A cache file name for something measured on this machine: the parts plus the ISA description
    and the torch version, hashed (quantization records here, step-cost tables in calibration.py)."""
    return hashlib.sha256("|".join([*parts, isa_description(), torch.__version__]).encode()).hexdigest()[:24]


def record_key(model_id: str, revision: str, method: str, dtype: torch.dtype, kv_dtype: torch.dtype) -> str:
    # the KV dtype named only when not fp32, so records measured over an fp32 pool keep their keys
    kv = [f"kv {kv_dtype}"] if kv_dtype != torch.float32 else []
    return cache_key(model_id, revision, method, str(dtype), *kv, EVAL_SET_HASH, kernel_description(method))


def load_cached(directory: Path | None, key: str) -> QuantizationRecord | None:
    if directory is None:
        return None
    path = directory / f"{key}.json"
    try:
        record = QuantizationRecord.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:  # a torn or foreign file: measure again
        log.warning("ignoring unreadable quantization record %s: %s", path, exc)
        return None
    record.cached = True
    return record


def save_cached(directory: Path | None, key: str, record: QuantizationRecord) -> None:
    if directory is None:
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(record.to_dict(), indent=1))
        os.replace(tmp, directory / f"{key}.json")  # atomic: concurrent pods on one volume never see half a file
    except OSError as exc:  # a read-only cache costs a re-evaluation on restart, nothing more
        log.warning("could not cache the quantization record in %s: %s", directory, exc)
