"""The HTTP API against the simulated runner: real uvicorn, real openai client, real scheduler."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from magnitude.server.app import ServerSettings
from magnitude.server.body_limit import context_body_bytes
from magnitude.server.simulated_runner import SIM_TEXT, ByteTokenizer

from .conftest import RunningServer, serve, sim_config, simulated


def client(s: RunningServer, **kw: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.v1, api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)  # type: ignore[arg-type]


def chat_prompt_tokens(content: str) -> int:
    tok = ByteTokenizer()
    return len(tok.apply_chat_template([{"role": "user", "content": content}], tokenize=True))


def test_models_lists_the_served_model(sim_server: RunningServer) -> None:
    models = client(sim_server).models.list()
    assert [m.id for m in models.data] == ["simulated"]


def test_chat_non_streaming_text_usage_and_timing(sim_server: RunningServer) -> None:
    r = client(sim_server).chat.completions.create(
        model="simulated", messages=[{"role": "user", "content": "hello"}], max_tokens=12
    )
    assert r.choices[0].message.content == SIM_TEXT[:12].decode()
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == chat_prompt_tokens("hello")
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    timing = r.model_extra["timing"]  # type: ignore[index]
    assert timing["ttft_ms"] >= timing["queue_time_ms"] >= 0
    assert timing["e2e_ms"] >= timing["ttft_ms"]
    assert timing["max_itl_ms"] >= timing["mean_itl_ms"] > 0


def test_chat_streaming_with_usage_matches_non_streaming(sim_server: RunningServer) -> None:
    c = client(sim_server)
    stream = c.chat.completions.create(
        model="simulated",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=9,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == SIM_TEXT[:9].decode()
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 9
    assert not chunks[-1].choices


def test_completions_stream_and_not_and_stop_string(sim_server: RunningServer) -> None:
    c = client(sim_server)
    r = c.completions.create(model="simulated", prompt="hi", max_tokens=30, stop=["brown"])
    assert r.choices[0].text == " The quick "
    assert r.choices[0].finish_reason == "stop"
    parts = [ch.choices[0].text for ch in c.completions.create(model="simulated", prompt="hi", max_tokens=30, stop=["brown"], stream=True) if ch.choices]
    assert "".join(parts) == " The quick "


def test_token_id_prompt_and_logprobs(sim_server: RunningServer) -> None:
    r = client(sim_server).completions.create(model="simulated", prompt=[104, 105], max_tokens=4, logprobs=2)
    assert r.usage is not None and r.usage.prompt_tokens == 2
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and "".join(lp.tokens) == r.choices[0].text
    chat = client(sim_server).chat.completions.create(
        model="simulated", messages=[{"role": "user", "content": "x"}], max_tokens=3, logprobs=True, top_logprobs=1
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 3 and all(len(t.top_logprobs) == 1 for t in content)


def test_progress_chunks_in_order_for_a_long_prompt() -> None:
    config = sim_config(scheduler__prefill_chunk_size=64, scheduler__token_budget=128)
    with serve(simulated(config), config) as s:
        body = {
            "model": "simulated",
            "messages": [{"role": "user", "content": "x" * 1000}],
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_progress": True, "include_usage": True},
        }
        events = []
        with httpx.stream("POST", s.v1 + "/chat/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
    phases = [e["progress"]["phase"] for e in events if "progress" in e]
    # preparing (the token count admission needs) comes before queued
    assert phases[:2] == ["preparing", "queued"] and phases[-1] == "generating"
    total = chat_prompt_tokens("x" * 1000)
    preparing = events[[i for i, e in enumerate(events) if "progress" in e][0]]["progress"]
    assert preparing["prompt_tokens"] == total and preparing["ms"] >= 0
    prefill = [e["progress"] for e in events if e.get("progress", {}).get("phase") == "prefill"]
    assert len(prefill) == -(-total // 64)  # one chunk per step
    assert [p["done"] for p in prefill] == sorted(p["done"] for p in prefill)
    assert prefill[-1] == {"phase": "prefill", "done": total, "total": total}
    first_content = next(i for i, e in enumerate(events) if e["choices"] and e["choices"][0].get("delta", {}).get("content"))
    last_progress = max(i for i, e in enumerate(events) if "progress" in e)
    assert last_progress < first_content
    assert events[-1]["usage"]["prompt_tokens"] == total


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/chat/completions", {"model": "simulated", "messages": []}, 400, "messages"),
        ("/chat/completions", {"model": "simulated"}, 400, "messages"),
        ("/chat/completions", {"model": "simulated", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
        ("/chat/completions", {"model": "simulated", "messages": [{"role": "user", "content": "x"}], "max_tokens": -3}, 400, "max_tokens"),
        ("/chat/completions", {"model": "simulated", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9}, 400, "max_tokens"),
        ("/chat/completions", {"model": "simulated", "messages": [{"role": "user", "content": "x"}], "max_tokens": 9000}, 400, "max_tokens"),
        ("/chat/completions", {"model": "simulated", "messages": [{"role": "user", "content": "x"}], "temperature": 3}, 400, "temperature"),
        ("/chat/completions", {"model": "simulated", "messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400, "top_p"),
        ("/chat/completions", {"model": "simulated", "messages": [{"role": "user", "content": "x"}], "top_k": -1}, 400, "top_k"),
        ("/chat/completions", {"model": "simulated", "messages": [{"role": "user", "content": "x"}], "n": 9}, 400, "n"),
        ("/chat/completions", {"model": "simulated", "messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}, 400, "max_tokens"),
        ("/chat/completions", {"model": "simulated", "messages": [{"role": "user", "content": "x"}], "priority_class": "vip"}, 400, "priority_class"),
        ("/chat/completions", {"model": "simulated", "messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}}, 400, None),
        ("/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
        ("/chat/completions", {"model": "simulated", "messages": [{"role": "user", "content": "x" * 9000}]}, 400, "messages"),
        ("/completions", {"model": "simulated", "prompt": ""}, 400, "prompt"),
        ("/completions", {"model": "simulated", "prompt": [999999]}, 400, "prompt"),
        ("/completions", {"model": "simulated", "prompt": "x", "stop": [""]}, 400, "stop"),
        ("/completions", {"model": "simulated", "prompt": "x", "logprobs": 99}, 400, "logprobs"),
        ("/completions", {"model": "simulated", "prompt": "x", "deadline_ms": -1}, 400, "deadline_ms"),
        ("/nothing", {}, 404, None),
    ],
)
def test_bad_input_is_named(sim_server: RunningServer, path: str, body: dict, status: int, param: str | None) -> None:
    r = httpx.post(sim_server.v1 + path, json=body, timeout=10)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param, err


def test_malformed_json_and_wrong_content(sim_server: RunningServer) -> None:
    r = httpx.post(sim_server.v1 + "/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "json_invalid"
    r = httpx.post(sim_server.v1 + "/chat/completions", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_api_key_guards_v1_only() -> None:
    config = sim_config()
    with serve(simulated(config), config, ServerSettings(api_key="s3cret")) as s:
        with pytest.raises(openai.AuthenticationError):
            client(s, api_key="wrong").models.list()
        r = httpx.get(s.v1 + "/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert client(s, api_key="s3cret").models.list().data
        assert httpx.get(s.url + "/healthz").status_code == 200
        assert httpx.get(s.url + "/readyz").status_code == 200


def test_tenant_and_priority_class_reach_metrics() -> None:
    config = sim_config()
    config.tenant_labels = ["acme"]
    with serve(simulated(config), config) as s:
        c = client(s)
        c.chat.completions.create(
            model="simulated", messages=[{"role": "user", "content": "a"}], max_tokens=2, user="acme",
            extra_body={"priority_class": "batch"},
        )
        c.chat.completions.create(
            model="simulated", messages=[{"role": "user", "content": "a"}], max_tokens=2,
            extra_headers={"X-Tenant": "someone-else"},
        )
        assert s.metric("magnitude_requests_finished_total", status="finished", priority_class="batch", tenant="acme") == 1
        assert s.metric("magnitude_requests_finished_total", status="finished", priority_class="standard", tenant="other") == 1
        assert s.metric("magnitude_generation_tokens_total") == 4


def test_oversized_body_is_413_not_buffered() -> None:
    config = sim_config()
    with serve(simulated(config), config, ServerSettings(max_body_bytes=10_000)) as s:
        big = {"model": "simulated", "messages": [{"role": "user", "content": "x" * 20_000}]}
        r = httpx.post(s.v1 + "/chat/completions", json=big)
        assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]

        def chunks():  # no Content-Length: counted as it streams in
            yield b'{"model": "simulated", "messages": [{"role": "user", "content": "'
            for _ in range(30):
                yield b"x" * 1000
            yield b'"}]}'

        r = httpx.post(s.v1 + "/chat/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        ok = {"model": "simulated", "messages": [{"role": "user", "content": "ok"}], "max_tokens": 2}
        assert httpx.post(s.v1 + "/chat/completions", json=ok).status_code == 200


def test_queue_time_is_observed_at_admission_once_not_at_the_end() -> None:
    config = sim_config()
    with serve(simulated(config, cost=lambda plan: 0.02), config) as s:
        body = {"model": "simulated", "messages": [{"role": "user", "content": "a"}], "max_tokens": 60, "stream": True}
        with httpx.stream("POST", s.v1 + "/chat/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(line for line in lines if '"content"' in line)  # generating now, ~1 s to go
            assert s.metric("magnitude_requests_finished_total", priority_class="standard") == 0
            assert s.metric("magnitude_queue_time_seconds_count", priority_class="standard") == 1
            # TTFT is still observed when the request ends (unchanged)
            assert s.metric("magnitude_time_to_first_token_seconds_count", priority_class="standard") == 0
            assert [line for line in lines if line][-1] == "data: [DONE]"
        assert s.metric("magnitude_requests_finished_total") == 1
        assert s.metric("magnitude_queue_time_seconds_count") == 1
        assert s.metric("magnitude_time_to_first_token_seconds_count") == 1


def test_queued_positions_count_down_to_the_head() -> None:
    import asyncio

    config = sim_config(scheduler__max_sequences=1)
    with serve(simulated(config, cost=lambda plan: 0.01), config) as s:
        body = {"model": "simulated", "messages": [{"role": "user", "content": "a"}], "max_tokens": 40, "stream": True,
                "stream_options": {"include_progress": True}}

        async def one(client: httpx.AsyncClient, i: int) -> list[int]:
            # Staggered: the queue orders by HTTP arrival, so a request that arrived first but
            # finished its preparation last would rightly move ahead of one already queued.
            await asyncio.sleep(0.05 * i)
            got = []
            async with client.stream("POST", s.v1 + "/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"queued"' in line:
                        got.append(json.loads(line[6:])["progress"]["position"])
            return got

        async def main() -> list[list[int]]:
            async with httpx.AsyncClient(timeout=30) as client:
                return await asyncio.gather(*(one(client, i) for i in range(4)))

        runs = asyncio.run(main())
    assert all(r == sorted(r, reverse=True) and len(set(r)) == len(r) for r in runs), runs  # only ever moves up
    assert all(r[-1] == 0 for r in runs), runs  # each reached the head before it ran
    assert max(r[0] for r in runs) >= 2, runs  # with one running slot, someone queued behind two others


class CountingRenderer:
    """Wraps the engine's PromptRenderer: counts tokenizer work and the threads it ran on."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.calls: list[tuple[str, str]] = []

    def __getattr__(self, name: str) -> object:
        attr = getattr(self.inner, name)
        if name not in ("chat", "text", "check_ids"):
            return attr

        def counted(*args: object) -> object:
            self.calls.append((name, threading.current_thread().name))
            return attr(*args)

        return counted


def test_prompt_over_the_character_bound_is_refused_before_tokenizing() -> None:
    """A prompt with more characters than the context's tokens times the longest token can never
    fit: 400 naming the limit, with no template rendering or tokenizing (4 M characters once cost
    seconds of CPU and hundreds of MB before the token count refused them)."""
    config = sim_config(admission__max_model_len=96)
    with serve(simulated(config), config, ServerSettings(max_body_bytes=64 << 20)) as s:
        renderer = CountingRenderer(s.engine.renderer)
        s.engine.renderer = renderer  # type: ignore[assignment]
        limit = s.engine.max_prompt_chars
        assert limit == 96 * len("<|endoftext|>")  # context x the longest token, a 13-character special
        for path, body in [
            ("/chat/completions", {"messages": [{"role": "user", "content": "x" * 4_000_000}]}),
            ("/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "y" * (limit + 1)}]}]}),
            ("/completions", {"prompt": "z" * (limit + 1)}),
            ("/completions", {"prompt": ["z" * (limit + 1)]}),
        ]:
            r = httpx.post(s.v1 + path, json={"model": "simulated", **body})
            error = r.json()["error"]
            assert r.status_code == 400 and error["code"] == "context_length_exceeded", r.text
            assert f"at most {limit} characters" in error["message"]
        assert renderer.calls == []
        # At the bound the prompt is tokenized (and its token count decides), in a worker thread.
        r = httpx.post(s.v1 + "/completions", json={"model": "simulated", "prompt": "z" * 50, "max_tokens": 2})
        assert r.status_code == 200
        assert [name for name, _ in renderer.calls] == ["text"]


def test_token_id_prompts_are_length_checked_first_and_checked_off_the_event_loop() -> None:
    config = sim_config(admission__max_model_len=96)
    with serve(simulated(config), config, ServerSettings(max_body_bytes=64 << 20)) as s:
        renderer = CountingRenderer(s.engine.renderer)
        s.engine.renderer = renderer  # type: ignore[assignment]
        r = httpx.post(s.v1 + "/completions", json={"model": "simulated", "prompt": [65] * 1_000_000})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert renderer.calls == []  # refused on its length, before a million ids were checked
        r = httpx.post(s.v1 + "/completions", json={"model": "simulated", "prompt": [65] * 20, "max_tokens": 2})
        assert r.status_code == 200
        [(name, thread)] = renderer.calls
        assert name == "check_ids" and not thread.startswith("uvicorn-")


def test_default_body_limit_is_what_the_context_can_use() -> None:
    config = sim_config(admission__max_model_len=96)
    with serve(simulated(config), config) as s:
        r = httpx.post(s.v1 + "/chat/completions",
                       json={"model": "simulated", "messages": [{"role": "user", "content": "x" * 4_000_000}]})
        assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]
        assert s.engine.max_body_bytes == context_body_bytes(96 * len("<|endoftext|>"), 96) < 4_000_000
        ok = {"model": "simulated", "messages": [{"role": "user", "content": "ok"}], "max_tokens": 2}
        assert httpx.post(s.v1 + "/chat/completions", json=ok).status_code == 200
