"""Seed scenarios for `magnitude trace`: each a small, seeded generator of a trace that shows one
thing about the scheduler (see docs/simulator.md for what each must show).

Sized for the default policy and the `linear` cost model, whose service rate is roughly
10 chat requests/s: `burst` and `overload` go above it, the others stay below it.
Pure and deterministic for a given seed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from magnitude.sim.trace import TraceRecord


@dataclass(frozen=True)
class ScenarioOptions:
    seed: int = 0
    n: int | None = None  # number of requests (scenario default if None)
    duration: float | None = None  # seconds of arrivals (scenario default if None)
    rate: float | None = None  # arrivals per second (scenario default if None)


def _poisson_arrivals(rng: random.Random, rate: float, n: int | None, duration: float | None, start: float = 0.0):
    t = start
    count = 0
    while True:
        t += rng.expovariate(rate)
        if (n is not None and count >= n) or (duration is not None and t > start + duration):
            return
        if n is None and duration is None:
            return
        count += 1
        yield t


def _lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(round(rng.lognormvariate(math.log(median), sigma)))))


def _chat(rng: random.Random, rid: str, t: float, **kw) -> TraceRecord:
    return TraceRecord(
        id=rid,
        arrival=round(t, 6),
        prompt_tokens=_lognormal_int(rng, 120, 0.6, 8, 1024),
        output_tokens=_lognormal_int(rng, 60, 0.5, 4, 400),
        **kw,
    )


def long_prompt(o: ScenarioOptions) -> list[TraceRecord]:
    """One very long prompt early on, plus short chats around it: chats must keep getting first tokens."""
    rng = random.Random(o.seed)
    recs = [TraceRecord(id="long-0", arrival=0.5, prompt_tokens=16_000, output_tokens=32, tenant="docs")]
    for i, t in enumerate(_poisson_arrivals(rng, o.rate or 4.0, o.n, o.duration or (None if o.n else 20.0))):
        recs.append(_chat(rng, f"chat-{i}", t, tenant="chat", priority_class="interactive"))
    return sorted(recs, key=lambda r: r.arrival)


def tenants(o: ScenarioOptions) -> list[TraceRecord]:
    """A heavy tenant at 10x the rate of a quiet one, together above service rate: the quiet one progresses."""
    rng = random.Random(o.seed)
    rate = o.rate or 25.0
    recs: list[TraceRecord] = []
    for i, t in enumerate(_poisson_arrivals(rng, rate, o.n, o.duration or (None if o.n else 30.0))):
        tenant = "quiet" if rng.random() < 1 / 11 else "heavy"
        recs.append(_chat(rng, f"{tenant}-{i}", t, tenant=tenant))
    return recs


def noisy_tenant(o: ScenarioOptions) -> list[TraceRecord]:
    """A noisy tenant arriving at about three times the service rate and a quiet one at about one
    request a second: the noisy one is rejected, the quiet one never is (its fair share serves it)."""
    rng = random.Random(o.seed)
    duration = o.duration or 30.0
    recs = [_chat(rng, f"noisy-{i}", t, tenant="noisy")
            for i, t in enumerate(_poisson_arrivals(rng, o.rate or 30.0, o.n, duration))]
    recs += [_chat(rng, f"quiet-{i}", t, tenant="quiet")
             for i, t in enumerate(_poisson_arrivals(rng, 1.0, None, duration))]
    return sorted(recs, key=lambda r: r.arrival)


def disconnects(o: ScenarioOptions) -> list[TraceRecord]:
    """A third of the clients disconnect during decode: their KV is reclaimed at once."""
    rng = random.Random(o.seed)
    recs = []
    for i, t in enumerate(_poisson_arrivals(rng, o.rate or 6.0, o.n, o.duration or (None if o.n else 20.0))):
        r = _chat(rng, f"r-{i}", t)
        if rng.random() < 1 / 3:
            r = r.model_copy(update={"output_tokens": max(r.output_tokens, 200), "cancel_at": round(t + rng.uniform(1.0, 3.0), 6)})
        recs.append(r)
    return recs


def burst(o: ScenarioOptions) -> list[TraceRecord]:
    """A burst well above service rate for a few seconds, then quiet traffic: queue time recovers."""
    rng = random.Random(o.seed)
    burst_n = o.n or 150
    recs = [_chat(rng, f"burst-{i}", rng.uniform(0.0, 2.0)) for i in range(burst_n)]
    for i, t in enumerate(_poisson_arrivals(rng, 2.0, None, o.duration or 40.0, start=2.0)):
        recs.append(_chat(rng, f"quiet-{i}", t))
    return sorted(recs, key=lambda r: r.arrival)


def overload(o: ScenarioOptions) -> list[TraceRecord]:
    """Sustained arrivals at about three times the service rate: admission rejects, with reasons."""
    rng = random.Random(o.seed)
    recs = []
    for i, t in enumerate(_poisson_arrivals(rng, o.rate or 30.0, o.n, o.duration or (None if o.n else 60.0))):
        recs.append(_chat(rng, f"r-{i}", t, tenant=f"t{rng.randrange(4)}"))
    return recs


def mixed(o: ScenarioOptions) -> list[TraceRecord]:
    """A realistic mix: classes, tenants, long documents, some disconnects and deadlines."""
    rng = random.Random(o.seed)
    recs = []
    n = o.n if o.n is not None or o.duration is not None else 2000
    for i, t in enumerate(_poisson_arrivals(rng, o.rate or 8.0, n, o.duration)):
        u = rng.random()
        cls = "interactive" if u < 0.5 else "standard" if u < 0.85 else "batch"
        tenant = rng.choices(["acme", "globex", "initech", "umbrella"], weights=[6, 3, 1, 1])[0]
        r = _chat(rng, f"m-{i}", t, tenant=tenant, priority_class=cls)
        if cls == "batch" and rng.random() < 0.5:
            r = r.model_copy(update={"prompt_tokens": _lognormal_int(rng, 2000, 0.5, 256, 8000)})
        if rng.random() < 0.05:
            r = r.model_copy(update={"cancel_at": round(t + rng.uniform(0.5, 5.0), 6)})
        if cls == "interactive" and rng.random() < 0.2:
            r = r.model_copy(update={"deadline": round(t + 30.0, 6)})
        recs.append(r)
    return recs


SCENARIOS: dict[str, Callable[[ScenarioOptions], list[TraceRecord]]] = {
    "long-prompt": long_prompt,
    "tenants": tenants,
    "noisy-tenant": noisy_tenant,
    "disconnects": disconnects,
    "burst": burst,
    "overload": overload,
    "mixed": mixed,
}


def generate(name: str, options: ScenarioOptions) -> list[TraceRecord]:
    try:
        gen = SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r} (known: {', '.join(SCENARIOS)})") from None
    return gen(options)
