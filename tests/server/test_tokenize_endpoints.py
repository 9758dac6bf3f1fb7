"""vLLM's `/tokenize` and `/detokenize` against the simulated runner's byte tokenizer."""

from __future__ import annotations

import httpx

from magnitude.server.simulated_runner import ByteTokenizer

from .conftest import RunningServer


def test_tokenize_text_and_back(sim_server: RunningServer) -> None:
    r = httpx.post(sim_server.url + "/tokenize", json={"model": "simulated", "prompt": "héllo", "return_token_strs": True})
    assert r.status_code == 200, r.text
    doc = r.json()
    expected = ByteTokenizer().encode("héllo", add_special_tokens=True)
    assert doc["tokens"] == expected and doc["count"] == len(expected)
    assert doc["max_model_len"] == sim_server.engine.max_model_len
    assert len(doc["token_strs"]) == len(expected)
    back = httpx.post(sim_server.url + "/detokenize", json={"tokens": doc["tokens"]})
    assert back.status_code == 200 and "héllo" in back.json()["prompt"]


def test_tokenize_chat_matches_what_a_chat_request_counts(sim_server: RunningServer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(sim_server.url + "/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    assert r.json()["token_strs"] is None
    chat = httpx.post(sim_server.v1 + "/chat/completions", json={"model": "simulated", "messages": messages, "max_tokens": 1})
    assert r.json()["count"] == chat.json()["usage"]["prompt_tokens"]


def test_bad_tokenizer_requests_name_the_parameter(sim_server: RunningServer) -> None:
    vocab = len(ByteTokenizer())
    r = httpx.post(sim_server.url + "/detokenize", json={"tokens": [1, vocab + 5]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = httpx.post(sim_server.url + "/tokenize", json={"model": "other", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
