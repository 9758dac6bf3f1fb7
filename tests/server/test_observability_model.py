"""Issue 16's "done means", on the real bundled model behind real uvicorn, scraped by real Prometheus.

One engine (a small KV cache and a token budget one prefill chunk wide, so that waiting and
preemption happen with a handful of requests) serves a short mixed trace:

- a long prompt (batch) and a short one (batch) sent together: the short one waits behind the
  long prompt's prefill (`defer` with reason `token_budget`), then generates; an interactive
  request with a prompt too big for the free KV blocks preempts it (`preempt`, reason
  `priority`), and it resumes (`admit`/`resumed`, `lost_ms`) and finishes; its timeline says
  exactly that, and its timing parts add up to e2e;
- shedding the batch class turns a batch request into a 429 that the decision log explains;
- a streamed request closed by the client (cancelled), and plain requests of each class;
- prompt lookup (draftModel ngram, mode on) drafts for every request, and a copy-heavy request
  gets most of its drafts accepted: the speculation panels (acceptance, tokens per target step,
  time saved) have data.

Two Prometheus servers (e2e/.bin/prometheus) scrape the engine every second, one labelling the
series as annotation-based pod scraping does (namespace, pod, pod labels through labelmap), one
as the Prometheus Operator does for a ServiceMonitor (namespace, pod, service, endpoint, job and
the podTargetLabels). Kubernetes service discovery is the stand-in here: static targets with the
labels discovery would attach (no cluster runs in this test). Then every panel query and template
variable of the chart's dashboard, with `$__rate_interval` substituted, is evaluated through each
Prometheus's HTTP API and must return data; and every series of the telemetry list appears on
/metrics (the vLLM-compatible ones too: the engine runs with `--metrics-compat vllm`'s registry).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import yaml

from magnitude.policy.schema import EngineConfig
from magnitude.server.app import ServerSettings
from magnitude.server.metrics import EngineMetrics, vllm_metric_names

from .conftest import RunningServer, free_port, serve

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "charts" / "magnitude" / "dashboards" / "magnitude.json"
ADMIN = {"Authorization": "Bearer adm"}
PARTS = ("queue_time_ms", "loading_ms", "preparation_ms", "prefill_ms", "decode_ms", "preempted_ms")
SCRAPE_S = 1
# Grafana's $__rate_interval is max($__interval + scrape interval, 4 x scrape interval); for a
# dashboard spanning this short run, the window that covers all of it.
RATE_INTERVAL = "10m"
NAMESPACE, MODELSERVICE = "ml", "chat"
MODES = {
    # annotation-based pod scraping: prometheus.io/* annotations, namespace/pod, labelmap of pod labels
    "annotations": {"job": "kubernetes-pods", "namespace": NAMESPACE, "pod": "chat-engine-0",
                    "app_kubernetes_io_name": "magnitude-engine", "serving_magnitude_dev_modelservice": MODELSERVICE},
    # the operator's ServiceMonitor through the Prometheus Operator (job is the Service's name)
    "servicemonitor": {"job": "chat", "namespace": NAMESPACE, "pod": "chat-engine-0", "service": "chat",
                       "endpoint": "http", "container": "engine", "serving_magnitude_dev_modelservice": MODELSERVICE},
}
# The telemetry list of issue 16 (and the series it builds on): each must be on /metrics.
TELEMETRY = (
    "magnitude_request_prefill_seconds_bucket", "magnitude_request_preparation_seconds_bucket",
    "magnitude_request_prompt_tokens_bucket", "magnitude_request_generation_tokens_bucket",
    "magnitude_batch_token_occupancy_bucket", "magnitude_batch_sequence_occupancy_bucket",
    "magnitude_prefix_cache_queries_total", "magnitude_prefix_cache_hits_total",
    "magnitude_kv_cache_blocks", "magnitude_kv_cache_blocks_used", "magnitude_kv_cache_blocks_cached",
    "magnitude_kv_cache_swap_blocks", "magnitude_kv_cache_swap_blocks_used",
    "magnitude_kv_cache_allocation_failures_total", "magnitude_preemptions_total", "magnitude_decisions_total",
    "magnitude_model_info", "magnitude_time_to_first_token_seconds_bucket", "magnitude_e2e_request_latency_seconds_bucket",
)


def require_prometheus() -> str:
    """e2e/.bin/prometheus (or PATH) through the harness's rule: skip without it, fail under CI=true."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("magnitude_e2e_cluster", ROOT / "e2e" / "cluster.py")
    assert spec and spec.loader
    cluster = sys.modules.setdefault("magnitude_e2e_cluster", importlib.util.module_from_spec(spec))
    if not hasattr(cluster, "require_tool"):
        spec.loader.exec_module(cluster)
    return cluster.require_tool("prometheus", "The engine-side checks need its scrapes: nothing ran")


MODEL: list[str] = []  # the served model's name, once loaded


def chat(content: str, priority_class: str, max_tokens: int, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL[0], "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "priority_class": priority_class, **kw}


def words(n: int, tag: str = "w") -> str:
    """About 3 tokens a word with the chat template's ~22; tags keep prompts from sharing cache blocks."""
    return " ".join(f"{tag}{i}" for i in range(n))


@contextmanager
def prometheus(binary: str, target: str, labels: dict[str, str], tmp: Path) -> Iterator[str]:
    port = free_port()
    config = {"global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
              "scrape_configs": [{"job_name": labels["job"], "metrics_path": "/metrics",
                                  "static_configs": [{"targets": [target],
                                                      "labels": {k: v for k, v in labels.items() if k != "job"}}]}]}
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    proc = subprocess.Popen([binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "prometheus exited"
            try:
                if httpx.get(url + "/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def query(url: str, expr: str) -> list[dict[str, Any]]:
    r = httpx.get(url + "/api/v1/query", params={"query": expr}, timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "success", (expr, r.text)
    return r.json()["data"]["result"]


def wait_scraped(url: str, n: int) -> None:
    """Until Prometheus has `n` more scrapes of the engine than now."""
    def count() -> float:
        got = query(url, "count_over_time(up[1h])")
        return float(got[0]["value"][1]) if got else 0.0
    start = count()
    deadline = time.monotonic() + 60
    while count() < start + n:
        assert time.monotonic() < deadline, "Prometheus stopped scraping"
        time.sleep(0.2)


def substitute(expr: str, variables: dict[str, str]) -> str:
    expr = expr.replace("$__rate_interval", RATE_INTERVAL)
    for name, value in variables.items():
        expr = expr.replace(f"${name}", value)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def debug(s: RunningServer, some_id: str) -> dict[str, Any]:
    r = httpx.get(f"{s.url}/debug/requests/{some_id}", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def assert_reconciles(timing: dict[str, Any]) -> None:
    total = sum(timing[k] or 0.0 for k in PARTS)
    assert abs(total - timing["e2e_ms"]) <= 0.001 * (len(PARTS) + 1), (total, timing)


@pytest.fixture(scope="module")
def engine() -> Iterator[RunningServer]:
    pytest.importorskip("torch")
    from magnitude.runner import ModelRunner

    # 24 blocks of 16 tokens; one 64-token prefill chunk fills the budget, so whatever arrives
    # with a long prompt's prefill waits for it.
    config = EngineConfig.model_validate({
        "kvCache": {"numBlocks": 24, "blockSize": 16},
        # No aging: on this loaded machine the victim may wait long enough to outrank the newcomer.
        "scheduler": {"tokenBudget": 64, "prefillChunkSize": 64, "maxSequences": 8, "preemptionMode": "recompute",
                      "agingSecondsPerLevel": None},
        "draftModel": {"method": "ngram", "mode": "on", "numSpeculativeTokens": 2},
    })
    metrics = EngineMetrics(tenant_labels=config.tenant_labels, compat="vllm", service_version="0123abcdef")
    from magnitude.runner.spec_decode import NgramProposer

    load = lambda progress: ModelRunner(num_blocks=24, block_size=16, progress=progress,  # noqa: E731
                                        draft_proposer=NgramProposer())
    with serve(load, config, ServerSettings(admin_token="adm"), metrics=metrics) as s:
        yield s


def run_trace(s: RunningServer, prom_urls: list[str]) -> dict[str, Any]:
    """The mixed trace; returns what the assertions need."""
    v1 = s.v1 + "/chat/completions"
    MODEL[:] = [s.engine.model_name]
    out: dict[str, Any] = {}
    with httpx.Client(timeout=600) as client:
        # warm-up requests of each class, so every class has observations in more than one scrape
        for cls in ("standard", "interactive", "batch"):
            assert client.post(v1, json=chat(words(12), cls, 3)).status_code == 200

        # 1. a long batch prompt (~260 tokens: four budget-wide chunks) and, right behind it, the victim
        results: dict[str, Any] = {}

        def send(name: str, body: dict[str, Any], rid: str) -> None:
            with httpx.Client(timeout=600) as c:
                r = c.post(v1, json=body, headers={"X-Request-Id": rid})
                results[name] = r

        long_t = threading.Thread(target=send, args=("long", chat(words(80, "l"), "batch", 2), "long-prompt"))
        long_t.start()
        while s.engine.request_log.find("long-prompt") is None:
            time.sleep(0.005)
        victim_t = threading.Thread(target=send, args=("victim", chat("Count to fifty.", "batch", 24), "victim"))
        victim_t.start()
        long_t.join()
        # 2. once the victim generates, an interactive request whose prompt (~370 tokens: all 24
        #    blocks) needs the victim's blocks
        while debug(s, "victim")["timing"]["decode_ms"] is None:
            time.sleep(0.02)
        r = client.post(v1, json=chat(words(113, "n"), "interactive", 2), headers={"X-Request-Id": "newcomer"})
        assert r.status_code == 200, r.text
        victim_t.join()
        assert results["long"].status_code == 200 and results["victim"].status_code == 200, results
        out["victim"] = results["victim"].json()

        # 3. a 429 the decision log explains
        out["since"] = client.get(s.url + "/debug/decisions", headers=ADMIN).json()["next"]
        assert client.post(s.url + "/admin/shedding", json={"classes": ["batch"]}, headers=ADMIN).status_code == 200
        r = client.post(v1, json=chat(words(8), "batch", 2), headers={"X-Request-Id": "shed-me"})
        assert r.status_code == 429, r.text
        out["rejected"] = r.json()
        assert client.post(s.url + "/admin/shedding", json={"enabled": False}, headers=ADMIN).status_code == 200

        # 4. a stream the client closes (cancelled), and the same prompt twice (a prefix-cache hit)
        with client.stream("POST", v1, json=chat(words(20), "standard", 60, stream=True)) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: {") and '"content"' in line:
                    break
        for _ in range(2):
            assert client.post(v1, json=chat(words(60), "standard", 2)).status_code == 200
        for cls in ("standard", "interactive", "batch"):
            assert client.post(v1, json=chat(words(14), cls, 3)).status_code == 200
        # 5. a copy-heavy answer: prompt lookup's drafts are mostly accepted. Twice, with a scrape
        #    between: the draft counters must grow between two samples, or the acceptance panel is
        #    0/0: a series whose every increment came before its first scrape has no rate, and the
        #    earlier requests may draft nothing (prompt lookup needs the answer to repeat the prompt),
        #    while one copy request can start and finish between two scrapes
        passage = "the keeper lit the lamp at dusk and wrote the weather in his log"
        copy = chat(f"Repeat exactly: {passage}. {passage}. {passage}.", "standard", 24)
        assert client.post(v1, json=copy).status_code == 200
        for url in prom_urls:
            wait_scraped(url, 1)
        assert client.post(v1, json=copy).status_code == 200
    return out


def test_timelines_metrics_and_every_dashboard_query_on_the_real_model(engine: RunningServer, tmp_path: Path) -> None:
    binary = require_prometheus()
    target = engine.url.removeprefix("http://")
    with ExitStack() as stack:
        proms = {mode: stack.enter_context(prometheus(binary, target, labels, tmp_path / mode))
                 for mode, labels in MODES.items()}
        for url in proms.values():
            wait_scraped(url, 2)
        out = run_trace(engine, list(proms.values()))
        for url in proms.values():
            wait_scraped(url, 3)  # counters touched last need two samples in the window

        # -- the victim's timeline: waited behind the long prompt, preempted, resumed, finished ----------
        doc = debug(engine, "victim")
        story = [(e["kind"], e["reason"]) for e in doc["events"] if e["kind"] not in ("prefill_chunk",)]
        newcomer = debug(engine, "newcomer")
        assert ("defer", "token_budget") in story and any(k[0] == "preempt" for k in story), (story, newcomer)
        i_defer = story.index(("defer", "token_budget"))
        i_admit = story.index(("admit", "scheduled"))
        i_first = story.index(("first_token", "sampled"))
        # for the newcomer's admission (priority) or for its chunks' growth (kv_blocks): timing decides
        i_preempt = next(i for i, k in enumerate(story) if k[0] == "preempt")
        assert story[i_preempt][1] in ("priority", "kv_blocks"), story
        i_resume = story.index(("admit", "resumed"))
        assert i_defer < i_admit < i_first < i_preempt < i_resume < story.index(("finish", "length")), story
        resumed = doc["events"][[e["reason"] for e in doc["events"]].index("resumed")]
        assert resumed["lost_ms"] > 0
        assert any(e["kind"] == "prefill_chunk" and e["reason"] == "recompute" for e in doc["events"])
        timing = out["victim"]["timing"]
        assert timing == doc["timing"]
        assert timing["queue_time_ms"] > 0 and timing["preempted_ms"] >= resumed["lost_ms"]
        assert_reconciles(timing)
        assert out["victim"]["usage"]["completion_tokens"] == 24
        assert ("admit", "scheduled") in [(e["kind"], e["reason"]) for e in newcomer["events"]]

        # -- the 429, explained --------------------------------------------------------------------------
        rejected = debug(engine, "shed-me")
        assert rejected["status"] == "rejected" and rejected["events"][-1]["kind"] == "reject"
        assert rejected["events"][-1]["reason"] == "shedding"
        page = httpx.get(engine.url + "/debug/decisions", params={"since": out["since"]}, headers=ADMIN).json()
        got = [(d["kind"], d["reason"], d["request"]) for d in page["decisions"]]
        assert ("shed", "admin", None) in got and ("reject", "shedding", rejected["id"]) in got
        assert got.index(("shed", "admin", None)) < got.index(("reject", "shedding", rejected["id"]))

        # -- every series on /metrics --------------------------------------------------------------------
        text = httpx.get(engine.url + "/metrics").text
        names = {re.split(r"[{ ]", line, maxsplit=1)[0] for line in text.splitlines() if line and line[0] != "#"}
        missing = [m for m in TELEMETRY if m not in names] + sorted(vllm_metric_names() - names)
        assert not missing, missing
        info = next(line for line in text.splitlines() if line.startswith("magnitude_model_info{"))
        assert 'service_version="0123abcdef"' in info
        assert engine.metric("magnitude_preemptions_total", mode="recompute") >= 1
        assert engine.metric("magnitude_kv_cache_allocation_failures_total") >= 1
        assert engine.metric("magnitude_prefix_cache_hits_total") >= 1
        assert engine.metric("magnitude_requests_finished_total", status="cancelled") == 1
        for name in ("magnitude_spec_decode_tokens_per_step_bucket", "magnitude_spec_decode_time_saved_seconds_total",
                     "magnitude_spec_decode_time_lost_seconds_total", "magnitude_spec_decode_enabled"):
            assert name in names, name
        proposed = engine.metric("magnitude_spec_decode_draft_tokens_total", priority_class="standard", method="ngram")
        accepted = engine.metric("magnitude_spec_decode_accepted_tokens_total", priority_class="standard", method="ngram")
        assert proposed > 0 and accepted > 0, (proposed, accepted)
        assert engine.metric("magnitude_spec_decode_tokens_per_step_count", priority_class="standard",
                             method="ngram") > 0

        # -- every dashboard query, through each Prometheus ----------------------------------------------
        board = json.loads(DASHBOARD.read_text())
        for mode, url in proms.items():
            variables = {"datasource": "prometheus"}
            for var in board["templating"]["list"]:
                if var["type"] != "query":
                    continue
                m = re.fullmatch(r"label_values\((.+), (\w+)\)", var["query"])
                assert m, var["query"]
                match, label = substitute(m.group(1), variables), m.group(2)
                r = httpx.get(f"{url}/api/v1/label/{label}/values", params={"match[]": match}).json()
                assert r["data"], (mode, var["name"], r)
                variables[var["name"]] = ".*"  # "All"
            for panel in board["panels"]:
                for target in panel["targets"]:
                    expr = substitute(target["expr"], variables)
                    result = query(url, expr)
                    values = [float(x["value"][1]) for x in result]
                    assert any(math.isfinite(v) for v in values), (mode, panel["title"], expr, result)
            # a ModelService selected by name as well as "All"
            one = substitute(board["panels"][0]["targets"][0]["expr"],
                             {**variables, "namespace": NAMESPACE, "modelservice": MODELSERVICE})
            assert query(url, one), (mode, one)
