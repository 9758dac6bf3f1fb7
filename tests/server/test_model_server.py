"""The real bundled model behind the real server, through the stock openai client.

One server for the whole session (`model_server`): loading and every step are slow on two cores,
so generations are short.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from .conftest import RunningServer

pytestmark = pytest.mark.model

PROMPTS = [
    "What is the capital of France?",
    "Name a primary color.",
    "Write the number after 41.",
    "Say hello in Spanish.",
    "What do bees make?",
    "Give me one word that rhymes with cat.",
    "What is 2 plus 2?",
    "Which planet do we live on?",
]


def client(s: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.v1, api_key="unused", max_retries=0, timeout=600)


def model_id(s: RunningServer) -> str:
    return client(s).models.list().data[0].id


def greedy_chat(s: RunningServer, prompt: str, max_tokens: int = 8) -> str:
    r = client(s).chat.completions.create(
        model=model_id(s), messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0
    )
    return r.choices[0].message.content or ""


def test_capital_of_france_contains_paris(model_server: RunningServer) -> None:
    assert "Paris" in greedy_chat(model_server, PROMPTS[0], max_tokens=16)


def test_chat_streaming_equals_non_streaming_and_usage_counts(model_server: RunningServer) -> None:
    c = client(model_server)
    messages = [{"role": "user", "content": PROMPTS[0]}]
    full = c.chat.completions.create(model=model_id(model_server), messages=messages, max_tokens=10, temperature=0)
    chunks = list(
        c.chat.completions.create(
            model=model_id(model_server), messages=messages, max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == full.choices[0].message.content
    tokenizer = model_server.engine.runner.tokenizer  # type: ignore[union-attr]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt_ids = prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids
    assert full.usage is not None and chunks[-1].usage is not None
    assert full.usage.prompt_tokens == len(prompt_ids) == chunks[-1].usage.prompt_tokens
    assert full.usage.completion_tokens == chunks[-1].usage.completion_tokens
    if full.choices[0].finish_reason == "length":
        assert full.usage.completion_tokens == 10
    # Re-encoding the text gives the same count (no special tokens in a short answer).
    assert abs(len(tokenizer.encode(streamed, add_special_tokens=False)) - full.usage.completion_tokens) <= 1


def test_completions_stream_and_not_with_ignore_eos(model_server: RunningServer) -> None:
    c = client(model_server)
    kw = dict(model=model_id(model_server), prompt="The capital of France is", max_tokens=6, temperature=0,
              extra_body={"ignore_eos": True})
    full = c.completions.create(**kw)  # type: ignore[arg-type]
    parts = [ch.choices[0].text for ch in c.completions.create(stream=True, **kw) if ch.choices]  # type: ignore[arg-type]
    assert "".join(parts) == full.choices[0].text
    assert full.usage is not None and full.usage.completion_tokens == 6
    assert full.choices[0].finish_reason == "length"


def test_eight_concurrent_greedy_requests_equal_each_alone(model_server: RunningServer) -> None:
    alone = [greedy_chat(model_server, p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: greedy_chat(model_server, p), PROMPTS))
    assert together == alone
    assert model_server.metric("magnitude_requests_running") == 0
    assert model_server.metric("magnitude_kv_cache_usage_ratio") == 0


def test_disconnect_mid_stream_frees_running_and_kv(model_server: RunningServer) -> None:
    import time

    import httpx

    body = {"model": model_id(model_server), "prompt": "Once upon a time", "max_tokens": 200, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", model_server.v1 + "/completions", json=body, timeout=300) as r:
        lines = r.iter_lines()
        while not next(lines).startswith('data: {"id"'):
            pass
        assert model_server.metric("magnitude_requests_running") == 1
        assert model_server.metric("magnitude_kv_cache_usage_ratio") > 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if model_server.metric("magnitude_requests_running") == 0 and model_server.metric("magnitude_kv_cache_usage_ratio") == 0:
            break
        time.sleep(0.1)
    assert model_server.metric("magnitude_requests_running") == 0
    assert model_server.metric("magnitude_kv_cache_usage_ratio") == 0
    assert model_server.metric("magnitude_requests_finished_total", status="cancelled") >= 1


def test_logprobs_are_real_and_greedy_picks_the_top(model_server: RunningServer) -> None:
    r = client(model_server).completions.create(
        model=model_id(model_server), prompt="The capital of France is", max_tokens=3, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == 3 and all(v <= 0.0 for v in lp.token_logprobs)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 2 and max(top.values()) == pytest.approx(chosen, abs=1e-4)


def test_prefix_cache_hit_shows_in_timeline_and_timing(model_server: RunningServer) -> None:
    """The same long prompt twice: the second reuses the first's full KV blocks, says so in its
    timeline and `timing.cached_prompt_tokens`, answers the same, and its timing adds up."""
    prompt = "Repeat after me, exactly: " + " ".join(PROMPTS)
    c = client(model_server)
    answers, timings = [], []
    for _ in range(2):
        r = c.chat.completions.create(model=model_id(model_server), messages=[{"role": "user", "content": prompt}],
                                      max_tokens=4, temperature=0)
        answers.append(r.choices[0].message.content)
        timings.append(r.model_extra["timing"])  # type: ignore[index]
        doc = model_server.engine.request_log.find(r.id)
        assert doc is not None and doc["timing"] == timings[-1]
    assert answers[0] == answers[1]
    block = model_server.engine.config.kv_cache.block_size
    # The first may reuse the chat template's system-prompt blocks from the module's earlier
    # requests; the second reuses at least the first's whole user prompt on top of that.
    first, second = timings[0]["cached_prompt_tokens"], timings[1]["cached_prompt_tokens"]
    assert first % block == 0 and second % block == 0
    assert second >= first + 4 * block and second >= r.usage.prompt_tokens - block, (first, second)
    assert r.usage.prompt_tokens_details.cached_tokens == second  # OpenAI's usage says the same
    hits = [e for e in doc["events"] if e["kind"] == "prefix_cache_hit"]
    assert [h["tokens"] for h in hits] == [timings[1]["cached_prompt_tokens"]]
    chunks = [e for e in doc["events"] if e["kind"] == "prefill_chunk"]
    assert chunks[0]["start"] == timings[1]["cached_prompt_tokens"]  # prefill starts after the cached part
    for t in timings:
        total = sum(t[k] or 0.0 for k in ("queue_time_ms", "loading_ms", "preparation_ms", "prefill_ms", "decode_ms", "preempted_ms"))
        assert abs(total - t["e2e_ms"]) <= 0.007


def test_logit_bias_and_penalties_steer_the_real_model(model_server: RunningServer) -> None:
    # Greedy, so each difference is the adjustment's doing: a banned first token is not produced,
    # and a frequency penalty stops "1, 1, 1, ..." style repetition of the prompt's pattern.
    c = client(model_server)
    messages = [{"role": "user", "content": "Repeat after me: yes yes yes yes yes yes yes yes"}]
    plain = c.chat.completions.create(model=model_id(model_server), messages=messages, max_tokens=12, temperature=0,
                                      logprobs=True)
    first = plain.choices[0].logprobs.content[0]  # type: ignore[union-attr]
    first_id = client_token_id(model_server, first.token)
    banned = c.chat.completions.create(model=model_id(model_server), messages=messages, max_tokens=12, temperature=0,
                                       logprobs=True, logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.content[0].token != first.token  # type: ignore[union-attr]
    penalized = c.chat.completions.create(model=model_id(model_server), messages=messages, max_tokens=12, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=2.0)
    repeats = (plain.choices[0].message.content or "").lower().count("yes")
    assert repeats > 2  # the unpenalized model does repeat
    assert (penalized.choices[0].message.content or "").lower().count("yes") < repeats


def client_token_id(s: RunningServer, token: str) -> int:
    tokenizer = s.engine.renderer.tokenizer  # type: ignore[union-attr]
    return tokenizer.convert_tokens_to_ids(tokenizer.convert_ids_to_tokens(tokenizer.encode(token, add_special_tokens=False))[0])
