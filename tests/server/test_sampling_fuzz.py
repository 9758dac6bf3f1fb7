"""Fuzz the sampling parameters through the REAL runner over real HTTP: no request may answer 5xx
(itself or a neighbour in its batch) and no KV block may stay held afterwards.

`test_fuzz.py` drives the simulated runner, which ignores sampling parameters; the sampler's
failure modes (a temperature too small to represent, a nucleus of 1e-12, extreme seeds, top-k
past the vocabulary, logprobs) only show on real logits. Requests go out in concurrent waves so
that extreme rows share steps with ordinary ones. Faults are injected too: about one request in
ten is marked (by its seed) and its logits are poisoned with NaN at the runner's sampling step;
exactly those requests must fail (500), alone. The figures are printed (run with `-s`).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import httpx
import pytest

from .conftest import RunningServer

NUM_REQUESTS = 120
WAVE = 24  # concurrent requests: they share the engine's steps
POISON_SEED = 4_242_424_242  # marks a request whose logits the injected fault turns to NaN
POISON_RATE = 0.1

TEMPERATURES = [0.0, 5e-324, 1e-45, 1e-40, 1e-30, 1e-8, 1e-6, 1e-5, 1e-3, 0.3, 1.0, 2.0]
TOP_PS = [5e-324, 1e-300, 1e-12, 1e-5, 0.1, 0.9, 1.0]
TOP_KS = [0, 1, 2, 50, 49151, 49152, 1_000_000]
SEEDS = [None, 0, 1, -(2**63), 2**63 - 1, 2**63, 2**64 - 1]
STOPS = [None, "\n", [" "], ["a", "e", "the"], [str(i) for i in range(8)]]
TEXTS = ["Hi", "The capital of France is", "Count: 1, 2, 3,", "Écris un poème 🍮 sur la mer.", " "]


def random_body(rng: random.Random, model: str) -> tuple[str, dict[str, Any]]:
    chat = rng.random() < 0.6
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": rng.randint(1, 4),
        "temperature": rng.choice(TEMPERATURES) if rng.random() < 0.8 else rng.uniform(0.0, 2.0),
        "top_p": rng.choice(TOP_PS) if rng.random() < 0.8 else rng.uniform(1e-9, 1.0),
        "top_k": rng.choice(TOP_KS),
        "seed": rng.choice(SEEDS) if rng.random() < 0.8 else rng.getrandbits(64),
        "stop": rng.choice(STOPS),
        "ignore_eos": rng.random() < 0.3,
        "deadline_ms": rng.choice([None, 600_000.0]),
    }
    if rng.random() < POISON_RATE:
        body["seed"] = POISON_SEED
    if rng.random() < 0.4:
        body["stream"] = True
        body["stream_options"] = {"include_usage": rng.random() < 0.5, "include_progress": rng.random() < 0.5}
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(TEXTS)}]
        if rng.random() < 0.4:
            body["logprobs"] = True
            body["top_logprobs"] = rng.randint(0, 20)
        return "/chat/completions", body
    kind = rng.random()
    if kind < 0.4:
        body["prompt"] = [rng.randrange(0, 49152) for _ in range(rng.randint(1, 24))]
    else:
        body["prompt"] = rng.choice(TEXTS) if kind < 0.7 else [rng.choice(TEXTS)]
    if rng.random() < 0.4:
        body["logprobs"] = rng.randint(0, 20)
    return "/completions", body


async def send(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[int, str]:
    """(status, text); a streamed error chunk counts with its own status class (server_error: 500)."""
    if not body.get("stream"):
        r = await client.post(url, json=body)
        return r.status_code, r.text
    async with client.stream("POST", url, json=body) as r:
        text = (await r.aread()).decode()
    if r.status_code == 200:
        for line in text.splitlines():
            if line.startswith("data: {") and '"error"' in line:
                err = json.loads(line[6:])["error"]
                return (500 if err.get("type") == "server_error" else 400), line
    return r.status_code, text


def poison_marked_rows(runner: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection at the runner: NaN logits for the rows of requests marked by POISON_SEED
    (one row per sampling sequence: this server proposes no drafts)."""
    original = runner._sample

    def _sample(samplers: list[Any], logits: Any, out: Any) -> None:
        marked = [i for i, w in enumerate(samplers) if w.seq.sampling.seed == POISON_SEED]
        if marked:
            logits = logits.clone()
            logits[marked, 0] = float("nan")
        original(samplers, logits, out)

    monkeypatch.setattr(runner, "_sample", _sample)


def test_random_sampling_parameters_and_faults_fail_no_innocent_request_and_leak_no_block(
    model_server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = model_server
    model = s.engine.model_name
    poison_marked_rows(s.engine.runner, monkeypatch)
    rng = random.Random(11)
    bodies = [random_body(rng, model) for _ in range(NUM_REQUESTS)]
    poisoned = [body.get("seed") == POISON_SEED for _, body in bodies]

    async def run() -> list[tuple[int, str]]:
        results: list[tuple[int, str]] = []
        async with httpx.AsyncClient(timeout=120) as client:
            for i in range(0, len(bodies), WAVE):
                wave = bodies[i : i + WAVE]
                results += await asyncio.gather(*(send(client, s.v1 + path, body) for path, body in wave))
        return results

    t0 = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - t0
    server_errors = [(bodies[i][1], text) for i, (status, text) in enumerate(results) if status >= 500 and not poisoned[i]]
    ok = sum(1 for status, _ in results if status == 200)
    faults_failed = [status >= 500 and "server_error" in text for (status, text), p in zip(results, poisoned) if p]
    loop = s.engine.loop
    assert loop is not None
    with loop.lock:
        kv = loop.scheduler.kv
        kv.check_invariants()
        leaked = kv.num_blocks - kv.num_free_blocks
        busy = loop.scheduler.has_work()
    print(f"\nsampling fuzz (real runner, real HTTP): {len(results)} requests fuzzed, {len(faults_failed)} faults "
          f"injected ({sum(faults_failed)} failed alone with 500), {ok} answered 200, {len(server_errors)} other "
          f"requests answered 5xx, {leaked} KV blocks leaked ({elapsed:.0f} s)")
    assert not server_errors, server_errors[:3]
    assert faults_failed and all(faults_failed)
    assert ok == len(results) - len(faults_failed), [r for r in results if r[0] != 200][:3]  # every body is valid
    assert not busy and leaked == 0
    assert httpx.get(s.url + "/readyz").status_code == 200
