"""Replay a trace JSONL against any OpenAI-compatible server and write a `simulate --json` report.

    python bench/loadgen.py TRACE.jsonl --url http://127.0.0.1:8000 [--model NAME] [--out REPORT.json]
        [--time-scale 1.0] [--prompt-ids 1000:20000] [--chat] [--limit N]

Each trace line becomes one streaming request at its arrival time (scaled by --time-scale) with
`max_tokens = output_tokens` and `ignore_eos`, so the server generates exactly what the trace
says. The prompt is the line's `prompt` text if present, else `prompt_tokens` token ids drawn
deterministically per request from --prompt-ids (the completions API takes token ids, so prompt
lengths match the trace exactly; distinct ids keep prefix caches from flattering the run).
`priority_class`, `tenant` (as `user`), `deadline` (as `deadline_ms`) and `cancel_at` (the client
hangs up) are honoured. With `--chat --json-schema-share F`, that share of the requests (chosen
by id) asks for `response_format` `json_schema` (CONTRACT_SCHEMA) without `ignore_eos`, with at
least 64 tokens of room; the server's verdict (`timing.output_contract`) is counted, and the
report's `loadgen.contracts` gives verified outputs per second next to tokens per second: the
cost of a verified answer, not of a token. Timing is measured on the client: TTFT at the first content chunk, ITL
between content chunks, e2e at the last; queue time comes from the server's `timing` extension
when present (Magnitude), else from its first `prefill` progress chunk, else it is null. A token
whose text waits for the next one reaches the client with it, so a client-side gap can span two
steps: the report's `loadgen.engine_longest_stall` gives, per tenant, the longest gap between tokens
as the server produced them (Magnitude's `timing.max_itl_ms`; empty for servers without it).

The report is built by the simulator's own `build_report` from engine `Request` objects filled
with these measurements, so a real run and `magnitude simulate --json` of the same trace compare
field by field (steps and events are empty: a client cannot see them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "server"), str(ROOT / "operator")]

from magnitude.engine.request import Request, RequestStatus  # noqa: E402
from magnitude.engine.sampling import SamplingParams  # noqa: E402
from magnitude.policy.schema import EngineConfig  # noqa: E402
from magnitude.sim.report import build_report, dump_report  # noqa: E402
from magnitude.sim.simulate import SimResult  # noqa: E402
from magnitude.sim.trace import TraceRecord, load_trace, write_atomic  # noqa: E402


# What --json-schema-share requests ask for: short, bounded, and checkable.
CONTRACT_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 60}, "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
    "required": ["answer", "confidence"], "additionalProperties": False,
}
CONTRACT_MIN_TOKENS = 64

# Errors inside a 200 stream carry only a code; map it to the status a non-streaming reply would have.
STREAM_ERROR_HTTP = {"deadline_exceeded": 504, "rejected": 429}


@dataclass
class Measured:
    status: RequestStatus = RequestStatus.FINISHED
    reason: str | None = None
    admitted: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    contract: str | None = None  # the server's output-contract verdict, when the request carried one
    # The server's `timing.max_itl_ms`: the longest gap between tokens as the engine produced them,
    # against token_times' gaps between chunks that carried text (a held-back token joins the next).
    engine_max_itl_ms: float | None = None


def prompt_for(rec: TraceRecord, ids: tuple[int, int]) -> str | list[int]:
    if rec.prompt:
        return rec.prompt
    rng = random.Random(rec.id)
    return [rng.randrange(*ids) for _ in range(rec.prompt_tokens)]


def request_body(rec: TraceRecord, args: argparse.Namespace, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": rec.output_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True, "include_progress": True},
        "ignore_eos": True,
    }
    prompt = prompt_for(rec, args.prompt_ids)
    if args.chat and wants_contract(rec, args.json_schema_share):
        body.pop("ignore_eos")
        body["max_tokens"] = max(rec.output_tokens, CONTRACT_MIN_TOKENS)
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": CONTRACT_SCHEMA}}
    if args.chat:
        text = prompt if isinstance(prompt, str) else " ".join(f"w{t}" for t in prompt)
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = prompt
    if rec.priority_class:
        body["priority_class"] = rec.priority_class
    if rec.tenant:
        body["user"] = rec.tenant
    if rec.deadline is not None:
        body["deadline_ms"] = max(1.0, (rec.deadline - rec.arrival) * 1000.0 * args.time_scale)
    return body


def wants_contract(rec: TraceRecord, share: float) -> bool:
    """Whether this request carries a JSON schema: a stable pick by id, so reruns choose the same."""
    return share > 0 and random.Random(f"contract:{rec.id}").random() < share


def _error_status(code: int, payload: dict[str, Any]) -> tuple[RequestStatus, str]:
    err = payload.get("error", {}) if isinstance(payload, dict) else {}
    reason = str(err.get("code") or err.get("message") or f"http_{code}")
    if 400 <= code < 500 and code != 408:  # refused before admission: overload (429) or bad input
        return RequestStatus.REJECTED, reason if code == 429 else f"http_{code}: {err.get('message', '')}"[:200]
    if code == 504 or "deadline" in reason:
        return RequestStatus.TIMED_OUT, reason
    return RequestStatus.FINISHED, f"error: http_{code}: {err.get('message', '')}"[:200]


async def run_one(client: httpx.AsyncClient, rec: TraceRecord, args: argparse.Namespace, model: str, t0: float) -> Measured:
    now = lambda: time.monotonic() - t0  # noqa: E731
    m = Measured()
    path = "/v1/chat/completions" if args.chat else "/v1/completions"
    await asyncio.sleep(max(0.0, rec.arrival * args.time_scale - now()))
    cancel_at = None if rec.cancel_at is None else rec.cancel_at * args.time_scale
    try:
        async with asyncio.timeout(None if cancel_at is None else max(0.0, cancel_at - now())):
            async with client.stream("POST", args.url + path, json=request_body(rec, args, model)) as resp:
                if resp.status_code != 200:
                    payload = json.loads(await resp.aread() or b"{}")
                    m.status, m.reason = _error_status(resp.status_code, payload)
                    m.finished = now()
                    return m
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    t = now()
                    if "error" in chunk:
                        m.status, m.reason = _error_status(STREAM_ERROR_HTTP.get(chunk["error"].get("code"), 500), chunk)
                        m.finished = t
                        return m
                    progress = chunk.get("progress") or {}
                    if progress.get("phase") == "prefill" and m.admitted is None:
                        m.admitted = t
                    for choice in chunk.get("choices") or []:
                        text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                        if text:
                            m.first_token = m.first_token if m.first_token is not None else t
                            m.token_times.append(t)
                        if choice.get("finish_reason"):
                            m.reason = choice["finish_reason"]
                    if chunk.get("usage"):
                        m.output_tokens = chunk["usage"]["completion_tokens"]
                        m.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    timing = chunk.get("timing") or {}
                    if timing.get("output_contract"):
                        m.contract = timing["output_contract"]
                    if timing.get("max_itl_ms") is not None:
                        m.engine_max_itl_ms = timing["max_itl_ms"]
                    if timing.get("queue_time_ms") is not None:
                        m.admitted = rec.arrival * args.time_scale + timing["queue_time_ms"] / 1000.0
                m.finished = now()
                m.output_tokens = m.output_tokens or len(m.token_times)
    except TimeoutError:
        m.status, m.reason, m.finished = RequestStatus.CANCELLED, "client_disconnected", now()
        m.output_tokens = len(m.token_times)
    except httpx.HTTPError as exc:
        m.status, m.reason, m.finished = RequestStatus.FINISHED, f"error: {type(exc).__name__}: {exc}"[:200], now()
    return m


def to_request(rec: TraceRecord, m: Measured, scale: float) -> Request:
    """An engine Request carrying the measurements, in trace time (divided by --time-scale)."""
    s = lambda t: None if t is None else t / scale  # noqa: E731
    req = Request(
        request_id=rec.id,
        prompt_token_ids=None,
        num_prompt_tokens=m.prompt_tokens or rec.prompt_tokens,
        sampling=SamplingParams(max_tokens=rec.output_tokens, temperature=0.0, ignore_eos=True),
        arrival_time=rec.arrival,
        priority_class=rec.priority_class or "",
        tenant=rec.tenant or "default",
        deadline=rec.deadline,
    )
    req.status = m.status
    req.finish_reason = m.reason
    req.admitted_time = s(m.admitted)
    req.first_token_time = s(m.first_token)
    req.token_times = [t / scale for t in m.token_times]
    req.finish_time = s(m.finished)
    req.output_token_ids = [0] * m.output_tokens
    return req


async def replay(records: list[TraceRecord], args: argparse.Namespace) -> tuple[list[Measured], float]:
    limits = httpx.Limits(max_connections=args.max_connections, max_keepalive_connections=args.max_connections)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout, connect=30.0), limits=limits) as client:
        model = args.model or (await client.get(args.url + "/v1/models")).json()["data"][0]["id"]
        t0 = time.monotonic()
        results = await asyncio.gather(*(run_one(client, r, args, model, t0) for r in records))
        return list(results), time.monotonic() - t0


def engine_stalls(records: list[TraceRecord], measured: list[Measured]) -> dict[str, float]:
    """Per tenant, the longest gap between output tokens the server reported (`timing.max_itl_ms`,
    seconds): servers that report none (llama-server) are left out."""
    out: dict[str, float] = {}
    for rec, m in zip(records, measured):
        if m.engine_max_itl_ms is not None:
            tenant = rec.tenant or "default"
            out[tenant] = max(out.get(tenant, 0.0), m.engine_max_itl_ms / 1000.0)
    return out


def contract_summary(measured: list[Measured], wall: float) -> dict[str, Any]:
    verdicts = [m.contract for m in measured if m.contract is not None]
    valid = verdicts.count("valid")
    return {"requests": len(verdicts), "valid": valid, "invalid": verdicts.count("invalid"),
            "unverified": verdicts.count("unverified"), "verified_outputs_per_s": valid / wall if wall > 0 else 0.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="loadgen", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", help="model name (default: the first of /v1/models)")
    p.add_argument("--out", help="write the report here (default: stdout)")
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions (default: /v1/completions)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival/cancel/deadline times")
    p.add_argument("--prompt-ids", default="1000:20000", help="LO:HI range of synthetic prompt token ids")
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--max-connections", type=int, default=512)
    p.add_argument("--timeout", type=float, default=900.0, help="per-request read timeout, seconds")
    p.add_argument("--json-schema-share", type=float, default=0.0,
                   help="with --chat: share of requests asking for a JSON schema (counted as verified outputs)")
    args = p.parse_args(argv)
    lo, _, hi = args.prompt_ids.partition(":")
    args.prompt_ids = (int(lo), int(hi))
    records = load_trace(args.trace)[: args.limit]
    measured, wall = asyncio.run(replay(records, args))
    pairs = [(rec, to_request(rec, m, args.time_scale)) for rec, m in zip(records, measured)]
    end = max((r.finish_time or 0.0) for _, r in pairs)
    result = SimResult(EngineConfig(), f"measured:{args.url}", pairs, [], [], end)
    report = build_report(result, include_steps=False, include_events=False)
    report["loadgen"] = {"url": args.url, "trace": args.trace, "wall_seconds": wall, "time_scale": args.time_scale,
                         "errors": sum(1 for _, r in pairs if (r.finish_reason or "").startswith("error")),
                         "contracts": contract_summary(measured, wall),
                         "engine_longest_stall": engine_stalls(records, measured)}
    text = dump_report(report)
    if args.out:
        write_atomic(args.out, text)
    else:
        sys.stdout.write(text)
    s = report["summary"]
    c = report["loadgen"]["contracts"]
    if c["requests"]:
        print(f"contracts: {c['requests']} asked, {c['valid']} valid, {c['invalid']} invalid, {c['unverified']} unverified | "
              f"{c['verified_outputs_per_s']:.3f} verified outputs/s", file=sys.stderr)
    print(
        f"requests {s['requests']} finished {s['finished']} rejected {s['rejected']} cancelled {s['cancelled']} "
        f"timed_out {s['timed_out']} errors {report['loadgen']['errors']} | {s['throughput_tokens_per_s']:.1f} tok/s | "
        f"ttft p50 {s['ttft']['p50']} p99 {s['ttft']['p99']} | itl p50 {s['itl']['p50']} p99 {s['itl']['p99']} | "
        f"queue p50 {s['queue_time']['p50']} p99 {s['queue_time']['p99']}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
