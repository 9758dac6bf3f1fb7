"""Simulator fidelity: record a trace from the real engine, replay it in the simulator, compare.

    PYTHONPATH=server .venv/bin/python bench/sim_fidelity.py [--n 24] [--seed 1] [--burst]
        [--cost-model COST.json] [--serve-arg=--dtype=bfloat16 ...] [--keep DIR]
    PYTHONPATH=server .venv/bin/python bench/sim_fidelity.py --replay DIR [--set K=V ...]   # a kept run, replayed again

1. `magnitude trace mixed --n N --seed S` (with --burst every arrival is 0: all N at once);
2. `magnitude serve --record-trace` (the real model on uvicorn) under `bench/loadgen.py` replaying
   the trace: the client-measured report is the engine's figures;
3. the cost model: the engine's own start-up calibration (`GET /debug/cost-model` after the load:
   the table measured in the same process just before it, with `meta.servedFixedSeconds`,
   `meta.servedPerDecodeSeconds` and `meta.servedOverPredicted`, the line this run's served steps fitted against the table, which a
   replay applies, and `meta.servedNoiseMargin`, the steps' scatter about it, which a replay's bound keeps, as it
   moved over the run: `meta.servedMarginHistory`, and the line as it moved, `meta.servedLineHistory`, both on the engine's clock, moved here with the recording onto the
   load generator's), or --cost-model FILE (e.g. `magnitude profile` output);
4. `magnitude simulate` of the recorded trace with the cost model (what an operator would replay),
   the same with the margin the engine ended with throughout (no history: "end margin"), the same
   with every step on the line the engine ended with (no line history: "end line"; a recording
   priced on the line in force at each step's start is the "recorded" one), the same with its
   prefill-only steps on the line too (no `meta.servedPrefillOnlyOverPredicted`: "prefill on
   line"; the recorded one prices them by their own ratio), the same without the
   served fit (the calibrated table alone), the same without the attention
   terms either (as before they existed), and the generated trace (arrivals only: no
   preparation, no prefix groups);
5. prints TTFT p50/p99, ITL p50, E2E p50 and throughput for each, and the ratio simulator / engine
   (target 0.85-1.15), with the load average: the machine is shared, so read the ratios, not the
   seconds; then the steps the engine ran (its magnitude_step_duration_seconds histogram: count and
   seconds) against the replay's, which tells a cost model that is off per step from a schedule
   that differs; and the limits the engine ended with (/readyz) against the replay's. The engine's
   scheduler decisions (`GET /debug/decisions`) are written beside the recording as decisions.json,
   their `t` moved onto the load generator's clock as the recording is, to set a request's admission
   beside the replay's events (`magnitude simulate --json`); --keep keeps the directory;
6. the requests whose first token came most apart (engine against the recorded replay): their
   class, prompt, arrival, TTFT in each, and when each admitted them, with the reasons they were
   deferred before (the engine's decisions, the replay's events): which requests a TTFT gap is in,
   and whether it is in admission or after it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "server"), str(ROOT / "operator"), str(ROOT / "bench")]

from magnitude.cli.main import main as cli  # noqa: E402
from magnitude.sim.trace import load_trace, write_trace  # noqa: E402

METRICS = (("ttft", "p50"), ("ttft", "p99"), ("itl", "p50"), ("e2e", "p50"))
PYTHON = str(ROOT / ".venv" / "bin" / "python")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def magnitude(*args: str) -> list[str]:
    return [PYTHON, "-m", "magnitude.cli.main", *args]


def run_cli(*args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli(list(args))
    if code:
        raise SystemExit(f"magnitude {' '.join(args)} exited {code}")
    return out.getvalue()


def figures(report: dict) -> dict[str, float | None]:
    s = report["summary"]
    out: dict[str, float | None] = {f"{m}_{p}": s[m][p] for m, p in METRICS}
    out["throughput"] = s["throughput_tokens_per_s"]
    out["finished"] = s["finished"]
    return out


def step_totals(metrics: str) -> tuple[int, float]:
    """(steps, seconds in steps) from the engine's magnitude_step_duration_seconds histogram."""
    values = {}
    for line in metrics.splitlines():
        name, _, value = line.partition(" ")
        if name in ("magnitude_step_duration_seconds_count", "magnitude_step_duration_seconds_sum"):
            values[name] = float(value)
    return int(values.get("magnitude_step_duration_seconds_count", 0)), values.get("magnitude_step_duration_seconds_sum", 0.0)


def sim_step_totals(report: dict) -> tuple[int, float, int]:
    """Steps, their seconds and the decodes they carried."""
    steps = report.get("steps") or []
    return len(steps), sum(s["duration"] for s in steps), sum(len(s["decode"]) for s in steps)


def _admission(events: list[dict], request_id: str) -> tuple[float | None, str]:
    """When `events` (decisions or a replay's events) first admit `request_id`, and the reasons it
    was deferred before, counted ("itl_target x3")."""
    admitted, reasons = None, {}
    for e in events:
        if e.get("request") != request_id:
            continue
        if e["kind"] == "admit":
            admitted = e["t"]
            break
        if e["kind"] == "defer":
            reasons[e.get("reason")] = reasons.get(e.get("reason"), 0) + 1
    return admitted, ", ".join(f"{r} x{n}" for r, n in reasons.items()) or "-"


def per_request(work: Path, replay: dict, shown: int = 8) -> None:
    """The `shown` requests whose first token came most apart in the engine and the replay: each
    engine request (the load generator's report, trace ids) is the recorded one of the same prompt
    and output lengths nearest its arrival (both on the load generator's clock)."""
    trace = {r.id: r for r in load_trace(work / "mixed.jsonl")}
    recorded = list(load_trace(work / "recorded.jsonl"))
    engine = json.loads((work / "mixed.real.json").read_text())["requests"]
    decisions_path = work / "decisions.json"
    decisions = json.loads(decisions_path.read_text()) if decisions_path.exists() else {}
    decisions = decisions.get("decisions", []) if isinstance(decisions, dict) else decisions
    replayed = {r["id"]: r for r in replay["requests"]}
    events = replay.get("events") or []
    rows = []
    for e in engine:
        t = trace[e["id"]]
        same = [r for r in recorded if (r.prompt_tokens, r.output_tokens) == (t.prompt_tokens, t.output_tokens)]
        if not same or e.get("first_token") is None:
            continue
        rec = min(same, key=lambda r: abs(r.arrival - e["arrival"]))
        sim = replayed.get(rec.id, {})
        if sim.get("first_token") is None:
            continue
        ttft_e, ttft_s = e["first_token"] - e["arrival"], sim["first_token"] - rec.arrival
        rows.append((abs(ttft_s - ttft_e), t, e["arrival"], ttft_e, ttft_s, _admission(decisions, rec.id),
                     _admission(events, rec.id)))
    rows.sort(key=lambda row: -row[0])
    print(f"requests whose first token came most apart ({len(rows)} with one in both; arrival and admission "
          f"on the load generator's clock):")
    print(f"{'id':>6} {'class':>12} {'prompt':>6} {'arrival':>8} {'ttft eng':>9} {'ttft sim':>9}  "
          f"{'admit eng':>9} {'deferred (engine)':<24} {'admit sim':>9} deferred (replay)")
    for _, t, arrival, ttft_e, ttft_s, (adm_e, why_e), (adm_s, why_s) in rows[:shown]:
        fmt = lambda v: f"{v:9.3f}" if v is not None else f"{'-':>9}"  # noqa: E731
        print(f"{t.id:>6} {t.priority_class or '-':>12} {t.prompt_tokens:>6} {arrival:8.3f} {ttft_e:9.3f} "
              f"{ttft_s:9.3f}  {fmt(adm_e)} {why_e:<24} {fmt(adm_s)} {why_s}")


def serve_and_load(trace: Path, recorded: Path, serve_args: list[str], env: dict[str, str], cost: Path) -> dict:
    """Serve, save the engine's calibrated cost model to `cost` (unless it exists), replay the trace."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**env, "MAGNITUDE_ADMIN_TOKEN": "fidelity"}
    server = subprocess.Popen(magnitude("serve", "--port", str(port), "--record-trace", str(recorded),
                                        "--log-level", "warning", *serve_args), env=env)
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            if server.poll() is not None:
                raise SystemExit(f"magnitude serve exited {server.returncode}")
            time.sleep(0.5)
        fetch = not cost.exists()
        real = trace.with_suffix(".real.json")
        subprocess.run([PYTHON, str(ROOT / "bench" / "loadgen.py"), str(trace), "--url", url, "--out", str(real)],
                       env=env, check=True)
        if fetch:  # after the load: with the line this run's served steps fitted against the table (meta.served*)
            r = httpx.get(url + "/debug/cost-model", headers={"Authorization": "Bearer fidelity"}, timeout=30)
            r.raise_for_status()
            cost.write_text(r.text)
        # The engine's scheduler decisions, to set a request's admission beside the replay's events.
        decisions, since = [], 0
        while True:
            page = httpx.get(url + "/debug/decisions", params={"since": since, "limit": 10_000},
                             headers={"Authorization": "Bearer fidelity"}, timeout=30).json()
            decisions += page["decisions"]
            if not page["decisions"] or page["next"] == since:
                break
            since = page["next"]
        trace.with_name("decisions.json").write_text(json.dumps(decisions))  # engine clock: main() moves it
        report = json.loads(real.read_text())
        report["engine_steps"] = step_totals(httpx.get(url + "/metrics", timeout=30).text)
        report["engine_limits"] = httpx.get(url + "/readyz", timeout=30).json().get("scheduler")
        return report
    finally:
        server.send_signal(signal.SIGTERM)  # the recorder flushes on the way out
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--burst", action="store_true", help="every request arrives at 0 (a saturated engine)")
    ap.add_argument("--time-scale", type=float, default=1.0,
                    help="multiply arrival, cancel and deadline times (slow machines: keep the load the trace meant)")
    ap.add_argument("--cost-model", help="a cost-model JSON (default: the engine's calibrated one, /debug/cost-model)")
    ap.add_argument("--serve-arg", action="append", default=[], help="passed to `magnitude serve`")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="an engine config override for both the server and the simulator")
    ap.add_argument("--keep", help="directory for the trace, recordings and reports (default: a temporary one)")
    ap.add_argument("--replay", metavar="DIR",
                    help="no engine run: replay the recording a run left in DIR (--keep) with this code's simulator")
    args = ap.parse_args()
    if args.replay:
        return compare(Path(args.replay), args, replayed=True)

    work = Path(args.keep or tempfile.mkdtemp(prefix="sim-fidelity-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'server'}:{ROOT / 'operator'}"}
    trace = work / "mixed.jsonl"
    text = run_cli("trace", "mixed", "--n", str(args.n), "--seed", str(args.seed))
    trace.write_text(text)
    records = load_trace(trace)
    scale = args.time_scale

    def moved(r, arrival: float):  # the same request arriving at `arrival`, its other times scaled alike
        return r.model_copy(update={
            "arrival": arrival,
            "cancel_at": None if r.cancel_at is None else arrival + (r.cancel_at - r.arrival) * scale,
            "deadline": None if r.deadline is None else arrival + (r.deadline - r.arrival) * scale})

    if args.burst or scale != 1.0:
        records = [moved(r, 0.0 if args.burst else r.arrival * scale) for r in records]
        write_trace(records, trace)

    cost = Path(args.cost_model) if args.cost_model else work / "cost.json"
    if not args.cost_model:
        cost.unlink(missing_ok=True)
    recorded = work / "recorded.jsonl"
    sets = [x for kv in args.sets for x in ("--set", kv)]
    engine_report = serve_and_load(trace, recorded, [*args.serve_arg, *sets], env, cost)
    (work / "engine.json").write_text(json.dumps({k: engine_report.get(k) for k in ("engine_steps", "engine_limits")}))
    rec = load_trace(recorded)
    # The recording's clock starts with the engine; the load generator's with its first request.
    shift = min(r.arrival for r in rec) - min(r.arrival for r in records)
    rec = [r.model_copy(update={"arrival": r.arrival - shift,
                                "cancel_at": None if r.cancel_at is None else r.cancel_at - shift,
                                "deadline": None if r.deadline is None else r.deadline - shift}) for r in rec]
    write_trace(rec, recorded)
    decisions = work / "decisions.json"
    decisions.write_text(json.dumps([{**d, "t": round(d["t"] - shift, 6)} for d in json.loads(decisions.read_text())]))
    if cost.exists() and not args.cost_model:
        doc = json.loads(cost.read_text())
        cost.write_text(json.dumps(shifted_histories(doc, shift)))
    return compare(work, args)


def shifted_histories(doc: dict, shift: float) -> dict:
    """The document with its margin's and line's histories (engine clock) moved `shift` seconds
    earlier, as the recording was: the entries before the new 0 collapse into the one in force
    there, at 0."""
    meta = dict(doc.get("meta") or {})
    for key in ("servedMarginHistory", "servedLineHistory"):
        history = meta.get(key)
        if not history:
            continue
        moved = [[round(entry[0] - shift, 3), *entry[1:]] for entry in history]
        before = [e for e in moved if e[0] <= 0.0]
        meta[key] = ([[0.0, *before[-1][1:]]] if before else []) + [e for e in moved if e[0] > 0.0]
    return {**doc, "meta": meta}


def compare(work: Path, args: argparse.Namespace, replayed: bool = False) -> int:
    """Replay `work`'s recording (recorded.jsonl, on the load generator's clock) with its cost
    model and print the figures against the engine's (mixed.real.json, engine.json)."""
    trace, recorded = work / "mixed.jsonl", work / "recorded.jsonl"
    cost = Path(args.cost_model) if args.cost_model else work / "cost.json"
    sets = [x for kv in args.sets for x in ("--set", kv)]
    engine_report = json.loads((work / "mixed.real.json").read_text())
    if (work / "engine.json").exists():
        engine_report.update(json.loads((work / "engine.json").read_text()))
    real = figures(engine_report)
    doc = json.loads(cost.read_text())
    unscaled_doc = {**doc, "meta": {k: v for k, v in (doc.get("meta") or {}).items()
                                    if k not in ("servedOverPredicted", "servedFixedSeconds", "servedPerDecodeSeconds",
                                                 "servedNoiseMargin", "servedMarginHistory", "servedLineHistory",
                                                 "servedSteps", "servedPrefillOnlyOverPredicted",
                                                 "servedPrefillOnlySteps")}}
    unscaled = work / "cost-unscaled.json"
    unscaled.write_text(json.dumps(unscaled_doc))
    table_only = work / "cost-table-only.json"
    table_only.write_text(json.dumps({k: v for k, v in unscaled_doc.items()
                                      if k not in ("per_decode_context_token", "per_attention_pair")}))
    replay = json.loads(run_cli("simulate", str(recorded), "--cost-model", str(cost), "--json", *sets))
    end_margin = work / "cost-end-margin.json"  # the peer: the margin the engine ended with, throughout
    end_margin.write_text(json.dumps({**doc, "meta": {k: v for k, v in (doc.get("meta") or {}).items()
                                                      if k != "servedMarginHistory"}}))
    end_line = work / "cost-end-line.json"  # the peer: every step on the line the engine ended with
    end_line.write_text(json.dumps({**doc, "meta": {k: v for k, v in (doc.get("meta") or {}).items()
                                                    if k != "servedLineHistory"}}))
    prefill_on_line = work / "cost-prefill-on-line.json"  # the peer: prefill-only steps priced on the line too
    prefill_on_line.write_text(json.dumps({**doc, "meta": {k: v for k, v in (doc.get("meta") or {}).items()
                                                           if k not in ("servedPrefillOnlyOverPredicted",
                                                                        "servedPrefillOnlySteps")}}))
    unscaled_replay = json.loads(run_cli("simulate", str(recorded), "--cost-model", str(unscaled), "--json", *sets))
    sims = {
        "recorded": figures(replay),
        "recorded end margin": figures(json.loads(run_cli("simulate", str(recorded), "--cost-model", str(end_margin),
                                                          "--json", *sets))),
        "recorded end line": figures(json.loads(run_cli("simulate", str(recorded), "--cost-model", str(end_line),
                                                        "--json", *sets))),
        "recorded prefill on line": figures(json.loads(run_cli("simulate", str(recorded), "--cost-model",
                                                               str(prefill_on_line), "--json", *sets))),
        "recorded unscaled": figures(unscaled_replay),
        "recorded table-only": figures(json.loads(run_cli("simulate", str(recorded), "--cost-model", str(table_only),
                                                          "--json", *sets))),
        "generated": figures(json.loads(run_cli("simulate", str(trace), "--cost-model", str(cost), "--json", *sets))),
    }
    meta = doc.get("meta") or {}
    if meta.get("servedFixedSeconds"):
        # The peer of the fitted line: the same served time spread as one ratio over the replay's
        # steps (fixed 0), what the engine kept before it fitted a fixed cost per step.
        n, seconds, decodes = sim_step_totals(unscaled_replay)
        extra = meta["servedFixedSeconds"] * n + meta.get("servedPerDecodeSeconds", 0.0) * decodes
        ratio = min(4.0, max(0.5, meta["servedOverPredicted"] + extra / seconds))
        one_ratio = work / "cost-one-ratio.json"
        one_ratio.write_text(json.dumps({**doc, "meta": {**{k: v for k, v in meta.items()
                                                            if k not in ("servedLineHistory", "servedPrefillOnlyOverPredicted",
                                                                         "servedPrefillOnlySteps")},
                                                         "servedOverPredicted": round(ratio, 4),
                                                         "servedFixedSeconds": 0.0, "servedPerDecodeSeconds": 0.0}}))
        sims[f"recorded one ratio {ratio:.3f}"] = figures(json.loads(run_cli(
            "simulate", str(recorded), "--cost-model", str(one_ratio), "--json", *sets)))
    load = os.getloadavg()
    burst = all(r.arrival == 0.0 for r in load_trace(trace))
    print(f"{'replayed ' if replayed else ''}{'burst' if burst else 'mixed'} n={args.n} seed={args.seed} time-scale={args.time_scale} "
          f"serve={' '.join(args.serve_arg) or '-'} set={' '.join(args.sets) or '-'} cost={cost} "
          f"served {meta.get('servedFixedSeconds')} s + {meta.get('servedPerDecodeSeconds')} s a decode + "
          f"{meta.get('servedOverPredicted')}x, margin {meta.get('servedNoiseMargin')} ({len(meta.get('servedMarginHistory') or [])} moves), {meta.get('servedSteps')} steps; "
          f"prefill-only {meta.get('servedPrefillOnlyOverPredicted')}x ({meta.get('servedPrefillOnlySteps')} steps)"
          f"  load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}  ({work})")
    names = [f"{m}_{p}" for m, p in METRICS] + ["throughput"]
    print(f"{'':>34}" + "".join(f"{n:>14}" for n in names))
    print(f"{'engine':>34}" + "".join(f"{real[n]:>14.4f}" for n in names))
    for label, sim in sims.items():
        print(f"{'sim ' + label:>34}" + "".join(f"{sim[n]:>14.4f}" for n in names))
        print(f"{'ratio sim/engine':>34}" + "".join(
            f"{(sim[n] / real[n] if real[n] else float('nan')):>14.3f}" for n in names))
    print(f"finished: engine {real['finished']}, " + ", ".join(f"sim {k} {v['finished']}" for k, v in sims.items()))
    # Whether a gap is in the steps' cost or in what they carry: the engine's steps (forward pass plus
    # scheduling, from its own histogram) against the replay's predicted steps.
    sn, ss, _ = sim_step_totals(replay)
    if engine_report.get("engine_steps"):  # kept since engine.json was written (a replay of an older run has none)
        en, es = engine_report["engine_steps"]
        print(f"steps: engine {en} in {es:.2f} s (mean {es / max(en, 1) * 1000:.1f} ms), "
              f"sim recorded {sn} in {ss:.2f} s (mean {ss / max(sn, 1) * 1000:.1f} ms), mean ratio sim/engine "
              f"{(ss / max(sn, 1)) / (es / max(en, 1)) if es else float('nan'):.3f}")
    else:
        print(f"steps: engine's not kept, sim recorded {sn} in {ss:.2f} s (mean {ss / max(sn, 1) * 1000:.1f} ms)")
    # Both start from the table's limits and derive them again from served steps at the 16th judged step
    # and every 64 after.
    sched = replay["config"]["scheduler"]
    last = (replay.get("limits_changes") or [{k: sched.get(k) for k in ("tokenBudget", "prefillChunkSize",
                                                                         "itlTargetMs")}])[-1]
    print(f"limits at the end: engine {engine_report.get('engine_limits')}, sim recorded {last} "
          f"({len(replay.get('limits_changes') or [])} changes)")
    per_request(work, replay)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
