"""n > 1: the choices of one request share the prompt's KV blocks (one prefill, n decodes), come
back with their indexes in full responses and streams, and free every block when the last ends."""

from __future__ import annotations

import json

import httpx

from .conftest import RunningServer, serve, sim_config, simulated

PROMPT = "Tell me a long story about a lighthouse keeper and the sea. " * 6  # several full blocks


def leaked_blocks(s: RunningServer) -> int:
    loop = s.engine.loop
    assert loop is not None
    with loop.lock:
        kv = loop.scheduler.kv
        kv.check_invariants()
        assert not loop.scheduler.has_work()
        return kv.num_blocks - kv.num_free_blocks


def test_choices_share_the_prompt_blocks_and_free_them(sim_server: RunningServer) -> None:
    r = httpx.post(sim_server.v1 + "/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": PROMPT}], "n": 3, "max_tokens": 6, "seed": 11, "temperature": 1.0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == sum(6 for _ in range(3))  # the simulated runner never stops early
    prompt_tokens = body["usage"]["prompt_tokens"]
    block = sim_server.engine.config.kv_cache.block_size
    rid = r.headers["x-request-id"]
    for i in (1, 2):
        doc = sim_server.engine.request_log.find(f"{rid}-{i}")
        assert doc is not None
        hits = [e["tokens"] for e in doc["events"] if e["kind"] == "prefix_cache_hit"]
        # All of the prompt's full blocks come from choice 0's prefill: at most the last partial
        # block is computed again.
        assert hits and hits[0] >= prompt_tokens - block, (hits, prompt_tokens)
    assert leaked_blocks(sim_server) == 0


def test_streamed_choices_carry_their_index_and_one_usage(sim_server: RunningServer) -> None:
    with httpx.stream("POST", sim_server.v1 + "/completions", timeout=60, json={
            "prompt": PROMPT, "n": 2, "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    finishes = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks
                if c["choices"] and c["choices"][0]["finish_reason"]}
    assert finishes == {0: "length", 1: "length"}
    text = {i: "".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i)
            for i in (0, 1)}
    assert all(text.values())
    (usage,) = [c["usage"] for c in chunks if c.get("usage")]
    assert usage["completion_tokens"] == 10
    assert leaked_blocks(sim_server) == 0


def test_n_above_max_choices_is_refused_before_anything_is_queued() -> None:
    config = sim_config(admission__max_choices=2)
    with serve(simulated(config), config) as s:
        r = httpx.post(s.v1 + "/completions", json={"prompt": "hi", "n": 3, "max_tokens": 2}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        assert "admission.maxChoices" in r.json()["error"]["message"]
