"""Fair admission through the server: a noisy tenant flooding a real uvicorn server past its
service rate gets 429 estimated_wait, while a quiet tenant sending a request every quarter second
is never refused, because its wait is estimated from where the fair order places it, not from the
whole backlog. The simulated runner stands in for the model's speed only (a fixed 20 ms step):
HTTP, the openai client, admission, the queue and the engine loop are the real ones."""

from __future__ import annotations

import threading
import time
from collections import Counter

import httpx
import openai

from .conftest import serve, sim_config, simulated


def test_a_noisy_tenant_over_capacity_does_not_get_a_quiet_one_rejected() -> None:
    config = sim_config(scheduler__tokenBudget=64, scheduler__prefillChunkSize=64, scheduler__maxSequences=4,
                        admission__maxQueueWaitSeconds=0.5)
    with serve(simulated(config, cost=lambda plan: 0.02), config) as s:
        stop = threading.Event()
        noisy: Counter[str] = Counter()

        def flood() -> None:
            with httpx.Client(timeout=30) as http:
                while not stop.is_set():
                    r = http.post(s.v1 + "/chat/completions", json={
                        "model": "simulated", "max_tokens": 20, "user": "noisy",
                        "messages": [{"role": "user", "content": "tell me more"}]})
                    noisy[str(r.status_code) + ":" + (r.json().get("error", {}).get("code") or "")] += 1
                    if r.status_code == 429:
                        time.sleep(0.01)

        threads = [threading.Thread(target=flood, daemon=True) for _ in range(32)]
        for t in threads:
            t.start()
        try:
            deadline = time.monotonic() + 20
            while noisy["429:estimated_wait"] < 5 and time.monotonic() < deadline:
                time.sleep(0.05)  # until the measured drain rate makes the noisy backlog's wait binding
            assert noisy["429:estimated_wait"] >= 5, noisy
            quiet = openai.OpenAI(base_url=s.v1, api_key="unused", max_retries=0)
            for i in range(8):
                reply = quiet.chat.completions.create(  # raises RateLimitError on a 429
                    model="simulated", max_tokens=4, user="quiet", messages=[{"role": "user", "content": f"q{i}"}])
                assert reply.choices[0].finish_reason == "length"
                time.sleep(0.25)
            assert s.metric("magnitude_requests_finished_total", status="rejected") >= 5
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        assert noisy["200:"] > 0 and noisy["429:estimated_wait"] > 0
