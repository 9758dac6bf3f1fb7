"""Faults from outside: pods that trickle, never finish or flood their answers, and API servers
that go silent. Each exchange must end with a reason, and one stuck ModelService must never hold
up another's tick.

The misbehaving pods and the silent API server are real loopback sockets (asyncio servers); the
ModelServices, pods and status live on the real kube-apiserver (opkit). Assertions are about
order and outcome (service B ticks again and again while A's scrape is still open), never about
how long something took."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from kubernetes import client as k8s

from magnitude.operator import loop, scrape
from magnitude.operator.apply import ApiError, Kube
from magnitude.operator.reconcile import reconcile
from opkit import NAME, ApiServer, Env
from test_scrape import GOOD

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nconnection: close\r\n"


class Pod:
    """A loopback HTTP server playing one engine pod. `mode` decides what a request gets:
    "good" (real engine metrics), "trickle" (a chunked body, one byte at a time, while
    `trickle_while()` holds, then endless), "endless" (64 KiB chunks for ever) or "silent"
    (reads the request, never answers)."""

    def __init__(self, mode: str, trickle_while: Callable[[], bool] = lambda: True) -> None:
        self.mode = mode
        self.trickle_while = trickle_while
        self.requests = 0
        self.open = 0  # exchanges the client has not ended yet
        self.server: asyncio.Server | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> "Pod":
        self.server = await asyncio.start_server(self._serve, host, port)
        return self

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.requests += 1
        self.open += 1
        try:
            await reader.readuntil(b"\r\n\r\n")
            if self.mode == "good":
                body = GOOD.encode()
                writer.write(HEAD + b"content-length: %d\r\n\r\n" % len(body) + body)
                await writer.drain()
            elif self.mode == "silent":
                await reader.read()  # until the client gives up and closes
            else:
                writer.write(HEAD + b"transfer-encoding: chunked\r\n\r\n")
                while self.mode == "trickle" and self.trickle_while():
                    writer.write(b"1\r\n#\r\n")
                    await writer.drain()
                    await asyncio.sleep(0.02)
                piece = b"# " + b"x" * 65533 + b"\n"
                while True:
                    writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client gave up: what these tests want
        finally:
            self.open -= 1
            writer.close()


def scrape_one(pod: Pod, monkeypatch: pytest.MonkeyPatch) -> scrape.PodLoad:
    monkeypatch.setenv(scrape.URL_TEMPLATE_ENV, "http://{ip}:" + str(pod.port))

    async def go() -> scrape.PodLoad:
        async with httpx.AsyncClient() as client:
            loads = await scrape.Scraper().scrape(client, [scrape.PodInfo("p0", "u0", "127.0.0.1", True)], "ml")
        return loads[0]
    return asyncio.run(go())


@pytest.mark.parametrize("mode, why", [("trickle", "no complete answer within"), ("endless", "byte cap"),
                                       ("silent", "no complete answer within")])
def test_a_scrape_gives_up_on_a_pod_with_a_reason(mode: str, why: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Today the 2 s timeout is per read: a pod sending a byte every 20 ms holds the scrape for
    ever, and an endless body is read into memory until the process dies."""
    monkeypatch.setattr(scrape, "SCRAPE_DEADLINE_SECONDS", 0.5)
    monkeypatch.setattr(scrape, "SCRAPE_MAX_BYTES", 1 << 20)

    async def go() -> scrape.PodLoad:
        pod = await Pod(mode).start()
        try:
            return await asyncio.wait_for(asyncio.to_thread(scrape_one, pod, monkeypatch), 30)
        finally:
            await pod.close()
    load = asyncio.run(go())
    assert load.kv_usage is None and load.problem is not None and why in load.problem, load


# ---- the Kubernetes API ------------------------------------------------------------------------

def kube_at(port: int, **limits: Any) -> Kube:
    conf = k8s.Configuration(host=f"http://127.0.0.1:{port}")
    return Kube(k8s.ApiClient(conf), **limits)


def call_in_thread(fn: Callable[[], Any], limit: float = 30.0) -> BaseException | None:
    """Run `fn` in a thread; its exception, or fail the test if it is still running after `limit`
    (today's client has no deadline: it would hang the test instead of failing it)."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            out.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit)
    if t.is_alive():
        pytest.fail(f"the API call was still running after {limit:.0f}s: no deadline", pytrace=False)
    return out[0]


@pytest.mark.parametrize("mode, why", [("silent", "timed out"), ("trickle", "no complete answer within"),
                                       ("endless", "byte cap")])
def test_every_api_call_has_a_deadline_and_a_byte_cap(mode: str, why: str) -> None:
    ready = threading.Event()
    holder: dict[str, Any] = {}

    def serve() -> None:
        async def main() -> None:
            pod = await Pod(mode).start()
            holder["port"], holder["loop"], holder["stop"] = pod.port, asyncio.get_running_loop(), asyncio.Event()
            ready.set()
            await holder["stop"].wait()
            await pod.close()
        asyncio.run(main())
    server = threading.Thread(target=serve, daemon=True)
    server.start()
    assert ready.wait(10)
    try:
        kube = kube_at(holder["port"], deadline=0.5, max_bytes=1 << 20)
        err = call_in_thread(lambda: kube.list_pods("ns", "a=b"))
    finally:
        holder["loop"].call_soon_threadsafe(holder["stop"].set)
        server.join(10)
    assert isinstance(err, ApiError) and err.temporary, err
    assert why in str(err) and "/api/v1/namespaces/ns/pods" in str(err), err


# ---- one stuck ModelService, one healthy one: the healthy one keeps ticking ----------------------

def two_loopback_ips() -> tuple[str, str, int]:
    """Two loopback addresses and one port free on both (pods share the engine port)."""
    for _ in range(20):
        with socket.socket() as s:
            s.bind(("127.0.0.2", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.3", port))
            return "127.0.0.2", "127.0.0.3", port
        except OSError:
            continue
    raise AssertionError("no port free on both loopback addresses")


SPEC: dict[str, Any] = {"replicas": 1, "minReplicas": 1, "maxReplicas": 3, "autoscaling": {"enabled": True}}


def test_one_stuck_service_never_delays_another(apiserver: ApiServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Service A's pod trickles its /metrics; service B's pod is healthy. B must tick again and
    again while A's first scrape is still open (today every tick waits for the slowest service,
    and A's never ends). Then A's pod floods: A's scrape gives up on the byte cap, and its Scaling
    condition and an Event name the pod and the reason."""
    a_env, b_env = Env(apiserver), Env(apiserver)
    ip_a, ip_b, port = two_loopback_ips()
    monkeypatch.setenv(scrape.URL_TEMPLATE_ENV, "http://{ip}:" + str(port))
    monkeypatch.setenv(loop.SYNC_SECONDS_ENV, "0.1")
    monkeypatch.setattr(scrape, "SCRAPE_DEADLINE_SECONDS", 600.0)  # the byte cap, not the clock, ends A's scrape
    for env, ip in ((a_env, ip_a), (b_env, ip_b)):
        reconcile(env.kube, env.body(**SPEC))
        env.add_pod("p0", ip)
    registry = loop.Registry()
    for env in (a_env, b_env):
        registry.entry(env.ns, NAME, env.current())
    scraped_a_while_open: list[int] = []

    async def go() -> None:
        pod_b = await Pod("good").start(ip_b, port)
        # A trickles until its open exchanges are counted below: flooding as soon as B's third
        # request came in let the byte cap end A's scrape before the count (seen: 0 open, 2 runs of 3)
        pod_a = await Pod("trickle", trickle_while=lambda: not scraped_a_while_open).start(ip_a, port)
        stop = asyncio.Event()
        task = asyncio.create_task(loop.run(a_env.kube, registry, stop))
        try:
            async def b_ticked_thrice() -> None:
                while pod_b.requests < 3:
                    assert not task.done(), task
                    await asyncio.sleep(0.05)
            await asyncio.wait_for(b_ticked_thrice(), 60)  # fails (not hangs) when B waits for A
            scraped_a_while_open.append(pod_a.open)

            def a_marked() -> bool:
                cond = next((c for c in a_env.status().get("conditions", []) if c["type"] == "Scaling"), {})
                return cond.get("reason") == "MetricsUnavailable" and "byte cap" in cond.get("message", "")
            while not await asyncio.to_thread(a_marked):
                assert not task.done(), task
                await asyncio.sleep(0.1)
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
            await pod_a.close()
            await pod_b.close()
    asyncio.run(asyncio.wait_for(go(), 120))
    # B's third scrape happened while A's scrape was still open (B never waited for it). Usually
    # exactly one exchange is open then; one CI run (stop 22) saw two, not yet explained, so the
    # test pins what it is about: at least one.
    assert len(scraped_a_while_open) == 1 and scraped_a_while_open[0] >= 1
    assert b_env.status()["load"]["podsScraped"] == 1
    cond = a_env.cond("Scaling")
    assert "pod p0 (scrape failed: answer is over the" in cond["message"], cond
    warnings = [e for e in a_env.events() if e["reason"] == "MetricsUnavailable"]
    assert warnings and warnings[0]["type"] == "Warning" and "pod p0" in warnings[0]["message"]


def test_a_tick_that_cannot_evaluate_metrics_still_corrects_drift(api: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever goes wrong between the scrape and the decision, the tick still reconciles: today an
    exception there (a KeyError from a bucket without `le`) skipped the reconcile every tick."""
    reconcile(api.kube, api.body(**SPEC))
    k8s.AppsV1Api(api.server.admin).patch_namespaced_deployment(NAME, api.ns, {"spec": {"template": {"spec": {
        "containers": [{"name": "engine", "image": "evil:latest"}]}}}}, field_manager="kubectl-edit")

    def broken(*_: Any, **__: Any) -> Any:
        raise KeyError("le")
    monkeypatch.setattr(loop, "decide", broken)

    async def go() -> None:
        async with httpx.AsyncClient() as client:
            await loop.tick(api.kube, loop.Entry(body=api.current()), client)
    asyncio.run(go())
    image = api.get("Deployment")["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image != "evil:latest"  # drift corrected
    cond = api.cond("Scaling")
    assert cond["reason"] == "MetricsUnavailable" and "could not be evaluated: KeyError" in cond["message"], cond


class SlowKube(Kube):
    """The operator's client to the real API server, except that listing pods in the namespaces
    in `stuck` waits until the test lets go: a slow admission webhook or API priority queue."""

    def __init__(self, inner: Kube, stuck: set[str], release: threading.Event) -> None:
        super().__init__(inner._api)
        self.stuck, self.release, self.waiting = stuck, release, 0

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        if namespace in self.stuck:
            self.waiting += 1
            self.release.wait(120)
        return super().list_pods(namespace, selector)


def test_services_stuck_in_api_calls_do_not_starve_the_others(apiserver: ApiServer,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight services whose API calls hang and one healthy one: the healthy one keeps ticking.
    Through asyncio's default executor (6 threads on 2 CPUs) its calls queued behind theirs."""
    envs = [Env(apiserver) for _ in range(9)]
    healthy = envs[-1]
    monkeypatch.setenv(loop.SYNC_SECONDS_ENV, "0.1")
    registry = loop.Registry()
    for env in envs:
        reconcile(env.kube, env.body(**SPEC))
        registry.entry(env.ns, NAME, env.current())
    release = threading.Event()
    kube = SlowKube(healthy.kube, {e.ns for e in envs[:-1]}, release)
    calls = {"healthy": 0}
    real_list = Kube.list_pods

    def counting(self: Kube, namespace: str, selector: str) -> list[dict[str, Any]]:
        if namespace == healthy.ns:
            calls["healthy"] += 1
        return real_list(self, namespace, selector)
    monkeypatch.setattr(Kube, "list_pods", counting)

    async def go() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(loop.run(kube, registry, stop))
        try:
            async def healthy_ticked_thrice_while_others_stuck() -> None:
                while calls["healthy"] < 3:
                    assert not task.done(), task
                    await asyncio.sleep(0.05)
            await asyncio.wait_for(healthy_ticked_thrice_while_others_stuck(), 60)
            assert kube.waiting == 8 and not release.is_set()
        finally:
            release.set()
            stop.set()
            await asyncio.wait_for(task, 60)
    asyncio.run(asyncio.wait_for(go(), 180))
