"""Who the tenant is (issue 11): auth modes none / apiKeys / trustedGateway.

Pure parts (the keys document, the reloading store on a fake clock, the per-request decision)
as plain functions; then the HTTP surface over real uvicorn with the simulated runner (the stock
`openai` client for the happy path), and `magnitude serve` as a process for flags and env vars.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from magnitude.server.app import ServerSettings
from magnitude.server.auth import (
    ApiKeyStore,
    AuthConfigError,
    Authenticator,
    AuthError,
    Claims,
    Decision,
    Identity,
    parse_api_keys,
)

from .conftest import RunningServer, free_port, serve, sim_config, simulated
from .test_serve_cli import env, serve_cmd, wait_ready

CLASSES = ["interactive", "standard", "batch"]
KEY_ACME = "acme-key-0123456789abcdef"
KEY_GLOBEX = "globex-key-0123456789abcdef"
KEY_NEW = "acme-rotated-0123456789abcdef"


def keys_doc(*entries: dict[str, Any]) -> str:
    return json.dumps({"keys": list(entries)})


def two_tenants() -> str:
    return keys_doc(
        {"key": KEY_ACME, "tenant": "acme", "priorityClasses": ["interactive", "standard"]},
        {"key": KEY_GLOBEX, "tenant": "globex", "priorityClasses": ["batch"]},
    )


# -- the keys document -------------------------------------------------------------------------------
def test_keys_document_yaml_and_json_map_keys_to_identities() -> None:
    yaml_text = f"keys:\n  - key: {KEY_ACME}\n    tenant: acme\n    priorityClasses: [batch]\n  - key: {KEY_GLOBEX}\n    tenant: globex\n"
    for text in (yaml_text, keys_doc({"key": KEY_ACME, "tenant": "acme", "priorityClasses": ["batch"]}, {"key": KEY_GLOBEX, "tenant": "globex"})):
        entries = parse_api_keys(text, CLASSES)
        identities = [identity for _, identity in entries]
        assert identities == [Identity("acme", ("batch",), None), Identity("globex", None, None)]
        # Only digests are kept: no entry holds the key's text.
        assert all(KEY_ACME.encode() not in digest for digest, _ in entries)


@pytest.mark.parametrize(
    ("doc", "named"),
    [
        ({"keys": [{"key": "short", "tenant": "a"}]}, "keys[0].key"),
        ({"keys": [{"key": KEY_ACME}]}, "keys[0].tenant"),
        ({"keys": [{"key": KEY_ACME, "tenant": "a", "priorityClasses": ["gold"]}]}, "keys[0]: unknown priority class 'gold'"),
        ({"keys": [{"key": KEY_ACME, "tenant": "a", "priorityClasses": ["batch"], "defaultPriorityClass": "standard"}]}, "keys[0]"),
        ({"keys": [{"key": KEY_ACME, "tenant": "a"}, {"key": KEY_ACME, "tenant": "b"}]}, "keys[1] repeats the key of keys[0]"),
        ({"keys": [{"key": KEY_ACME, "tenant": "a", "tennant": "b"}]}, "keys[0].tennant"),
        ({"keys": []}, "keys"),
        ({"tenants": {}}, "keys"),
    ],
)
def test_malformed_keys_document_names_the_entry_and_never_echoes_a_key(doc: dict[str, Any], named: str) -> None:
    with pytest.raises(AuthConfigError) as err:
        parse_api_keys(json.dumps(doc), CLASSES, "keys.json")
    assert str(err.value).startswith("keys.json: ") and named in str(err.value)
    assert KEY_ACME not in str(err.value)


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_store_reloads_on_content_change_at_most_every_interval_and_keeps_the_last_good_keys(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(keys_doc({"key": KEY_ACME, "tenant": "acme"}))
    clock = FakeClock()
    store = ApiKeyStore(str(path), CLASSES, reload_interval_s=2.0, clock=clock)
    assert store.lookup(KEY_ACME) == Identity("acme")
    path.write_text(keys_doc({"key": KEY_NEW, "tenant": "acme"}))
    clock.t = 1.0  # within the interval: the file is not re-read yet
    assert store.lookup(KEY_ACME) == Identity("acme") and store.lookup(KEY_NEW) is None
    clock.t = 2.5
    assert store.lookup(KEY_ACME) is None and store.lookup(KEY_NEW) == Identity("acme")
    path.write_text("{not json")  # a broken update keeps the previous keys
    clock.t = 5.0
    assert store.lookup(KEY_NEW) == Identity("acme")
    path.unlink()
    clock.t = 8.0
    assert store.lookup(KEY_NEW) == Identity("acme")


# -- the decision ------------------------------------------------------------------------------------
ACME = Identity("acme", ("interactive", "standard"))
BATCH_ONLY = Identity("globex", ("batch",))


@pytest.mark.parametrize(
    ("mode", "identity", "claims", "expected"),
    [
        # none: the claims are believed, as before
        ("none", None, Claims(x_tenant="t1", user="u"), Decision("t1", "standard")),
        ("none", None, Claims(user=" u ", priority_class="batch"), Decision("u", "batch")),
        ("none", None, Claims(), Decision("default", "standard")),
        ("none", None, Claims(gateway_tenant="t"), (400, "X-Magnitude-Tenant", "untrusted_header")),
        ("none", None, Claims(gateway_class="batch"), (400, "X-Magnitude-Priority-Class", "untrusted_header")),
        # apiKeys: the key decides; agreeing claims pass, conflicting ones are refused by name
        ("apiKeys", ACME, Claims(), Decision("acme", "standard")),
        ("apiKeys", ACME, Claims(user="acme", x_tenant="acme", priority_class="interactive"), Decision("acme", "interactive")),
        ("apiKeys", ACME, Claims(user="globex"), (403, "user", "tenant_mismatch")),
        ("apiKeys", ACME, Claims(x_tenant="globex"), (403, "X-Tenant", "tenant_mismatch")),
        ("apiKeys", ACME, Claims(priority_class="batch"), (403, "priority_class", "priority_class_forbidden")),
        ("apiKeys", BATCH_ONLY, Claims(), Decision("globex", "batch")),  # the engine default is not allowed: its first class
        ("apiKeys", Identity("a", None, "interactive"), Claims(), Decision("a", "interactive")),
        ("apiKeys", ACME, Claims(gateway_tenant="acme"), (400, "X-Magnitude-Tenant", "untrusted_header")),
        ("apiKeys", None, Claims(user="acme"), (401, None, "invalid_api_key")),  # no key: never the claim
        # trustedGateway: the headers decide
        ("trustedGateway", None, Claims(gateway_tenant="acme", gateway_class="batch"), Decision("acme", "batch", "X-Magnitude-Priority-Class")),
        ("trustedGateway", None, Claims(gateway_tenant="acme", priority_class="batch", user="acme"), Decision("acme", "batch")),
        ("trustedGateway", None, Claims(x_tenant="acme"), (401, "X-Magnitude-Tenant", "missing_gateway_identity")),
        ("trustedGateway", None, Claims(gateway_tenant="acme", x_tenant="globex"), (403, "X-Tenant", "tenant_mismatch")),
        ("trustedGateway", None, Claims(gateway_tenant="a", gateway_class="batch", priority_class="interactive"), (403, "priority_class", "priority_class_mismatch")),
    ],
)
def test_decision_table(mode: str, identity: Identity | None, claims: Claims, expected: Decision | tuple[int, str | None, str]) -> None:
    auth = Authenticator(mode)
    if isinstance(expected, Decision):
        assert auth.decide(identity, claims, "standard") == expected
        return
    with pytest.raises(AuthError) as err:
        auth.decide(identity, claims, "standard")
    assert (err.value.status, err.value.param, err.value.code) == expected
    assert expected[1] is None or expected[1] in err.value.message  # the message names what was refused


@pytest.mark.parametrize(
    ("mode", "api_key", "keys_file", "named"),
    [
        ("apiKeys", None, None, "--api-keys-file"),
        ("apiKeys", "k" * 20, "KEYS", "--api-key"),
        ("none", None, "KEYS", "--api-keys-file"),
        ("trustedGateway", None, "KEYS", "--api-keys-file"),
        ("oauth", None, None, "--auth-mode"),
        ("apiKeys", None, "/nonexistent/keys.yaml", "/nonexistent/keys.yaml"),
    ],
)
def test_bad_combinations_are_refused_naming_the_flag(tmp_path: Path, mode: str, api_key: str | None, keys_file: str | None, named: str) -> None:
    if keys_file == "KEYS":
        keys_file = str(tmp_path / "keys.json")
        Path(keys_file).write_text(two_tenants())
    with pytest.raises(AuthConfigError, match=named):
        Authenticator.build(mode, api_key, keys_file, CLASSES)


# -- over HTTP ---------------------------------------------------------------------------------------
def chat(model: str = "simulated", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, **extra}


def post(s: RunningServer, body: dict[str, Any], key: str | None = None, **headers: str) -> httpx.Response:
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(s.v1 + "/chat/completions", json=body, headers=headers, timeout=30)


@pytest.fixture
def keys_server(tmp_path: Path) -> Iterator[RunningServer]:
    path = tmp_path / "keys.yaml"
    path.write_text(two_tenants())
    config = sim_config()
    config.tenant_labels = ["acme", "globex"]
    settings = ServerSettings(auth_mode="apiKeys", api_keys_file=str(path), api_keys_reload_s=0.0)
    with serve(simulated(config), config, settings) as s:
        s.keys_path = path  # type: ignore[attr-defined]
        yield s


def test_api_keys_tenant_comes_from_the_key_and_reaches_the_scheduler(keys_server: RunningServer) -> None:
    s = keys_server
    c = openai.OpenAI(base_url=s.v1, api_key=KEY_ACME, max_retries=0)
    assert [m.id for m in c.models.list().data] == ["simulated"]
    r = c.chat.completions.create(model="simulated", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert r.choices[0].finish_reason == "length"
    # A claim that agrees with the key is fine; the class defaults within what the key allows.
    c.chat.completions.create(model="simulated", messages=[{"role": "user", "content": "hi"}], max_tokens=3, user="acme")
    assert s.metric("magnitude_requests_finished_total", status="finished", priority_class="standard", tenant="acme") == 2
    r2 = post(s, chat(), KEY_GLOBEX)
    assert r2.status_code == 200
    assert s.metric("magnitude_requests_finished_total", status="finished", priority_class="batch", tenant="globex") == 1


def test_api_keys_are_required_on_every_v1_route(keys_server: RunningServer) -> None:
    s = keys_server
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=s.v1, api_key="not-a-key-0123456789", max_retries=0).models.list()
    for r in (post(s, chat()), post(s, chat(), "wrong-key-0123456789abcdef"), httpx.get(s.v1 + "/models")):
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(s.url + "/healthz").status_code == 200  # probes stay open


def test_api_keys_a_client_cannot_claim_another_tenant(keys_server: RunningServer) -> None:
    s = keys_server
    r = post(s, chat(user="globex"), KEY_ACME)
    assert r.status_code == 403 and r.json()["error"]["param"] == "user" and r.json()["error"]["code"] == "tenant_mismatch"
    r = post(s, chat(), KEY_ACME, **{"X-Tenant": "globex"})
    assert r.status_code == 403 and r.json()["error"]["param"] == "X-Tenant"
    assert s.metric("magnitude_requests_finished_total", tenant="globex") == 0


def test_api_keys_a_key_cannot_use_a_class_it_is_not_allowed(keys_server: RunningServer) -> None:
    s = keys_server
    r = post(s, chat(priority_class="batch"), KEY_ACME)
    err = r.json()["error"]
    assert r.status_code == 403 and err["code"] == "priority_class_forbidden" and err["param"] == "priority_class"
    assert "'batch'" in err["message"]
    assert post(s, chat(priority_class="interactive"), KEY_ACME).status_code == 200


def test_api_keys_gateway_headers_are_refused_by_name(keys_server: RunningServer) -> None:
    r = post(keys_server, chat(), KEY_ACME, **{"X-Magnitude-Tenant": "globex"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Magnitude-Tenant"


def test_rotated_keys_file_takes_effect_without_a_restart(keys_server: RunningServer) -> None:
    s = keys_server
    assert post(s, chat(), KEY_ACME).status_code == 200
    s.keys_path.write_text(keys_doc({"key": KEY_NEW, "tenant": "acme"}))  # type: ignore[attr-defined]
    assert post(s, chat(), KEY_ACME).status_code == 401
    assert post(s, chat(), KEY_NEW).status_code == 200
    assert s.metric("magnitude_requests_finished_total", status="finished", tenant="acme") == 2


def test_prefix_cache_is_keyed_by_the_key_tenant_not_the_claim(tmp_path: Path) -> None:
    """A shared prompt hits the cache only for the tenant whose key sent it before."""
    path = tmp_path / "keys.json"
    path.write_text(two_tenants())
    config = sim_config()
    settings = ServerSettings(auth_mode="apiKeys", api_keys_file=str(path))
    prompt = {"model": "simulated", "messages": [{"role": "user", "content": "a long shared prefix " * 8}], "max_tokens": 1}
    with serve(simulated(config), config, settings) as s:
        kv = s.engine.loop.scheduler.kv  # type: ignore[union-attr]
        assert post(s, prompt, KEY_ACME).status_code == 200
        hits = kv.prefix_hits
        assert post(s, {**prompt, "priority_class": "batch"}, KEY_GLOBEX).status_code == 200
        assert kv.prefix_hits == hits  # globex's request found none of acme's blocks
        assert post(s, prompt, KEY_ACME).status_code == 200
        assert kv.prefix_hits > hits  # the same prompt from acme's key does hit


def test_trusted_gateway_headers_decide_tenant_and_class() -> None:
    config = sim_config()
    config.tenant_labels = ["acme"]
    with serve(simulated(config), config, ServerSettings(auth_mode="trustedGateway")) as s:
        r = post(s, chat(), **{"X-Magnitude-Tenant": "acme", "X-Magnitude-Priority-Class": "batch"})
        assert r.status_code == 200
        assert s.metric("magnitude_requests_finished_total", status="finished", priority_class="batch", tenant="acme") == 1
        r = post(s, chat(), **{"X-Tenant": "acme"})  # around the gateway
        assert r.status_code == 401 and r.json()["error"]["param"] == "X-Magnitude-Tenant"
        r = post(s, chat(), **{"X-Magnitude-Tenant": "acme", "X-Magnitude-Priority-Class": "gold"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Magnitude-Priority-Class"


def test_trusted_gateway_with_api_key_requires_both() -> None:
    config = sim_config()
    with serve(simulated(config), config, ServerSettings(auth_mode="trustedGateway", api_key="gateway-secret")) as s:
        assert post(s, chat(), **{"X-Magnitude-Tenant": "acme"}).status_code == 401
        assert post(s, chat(), "gateway-secret", **{"X-Magnitude-Tenant": "acme"}).status_code == 200


def test_mode_none_refuses_the_gateway_headers_and_keeps_the_claims(sim_server: RunningServer) -> None:
    for header in ("X-Magnitude-Tenant", "X-Magnitude-Priority-Class"):
        r = post(sim_server, chat(), **{header: "batch"})
        assert r.status_code == 400 and r.json()["error"]["param"] == header
        assert r.json()["error"]["code"] == "untrusted_header"
    assert post(sim_server, chat(user="anyone"), **{"X-Tenant": "t1"}).status_code == 200


# -- magnitude serve ---------------------------------------------------------------------------------
def test_serve_exits_2_on_a_malformed_keys_file_naming_the_entry(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(f"keys:\n  - key: {KEY_ACME}\n    tenant: acme\n    priorityClasses: [gold]\n")
    r = subprocess.run(serve_cmd("--runner", "simulated", "--auth-mode", "apiKeys", "--api-keys-file", str(path)),
                       env=env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "keys[0]" in r.stderr and "gold" in r.stderr and KEY_ACME not in r.stderr
    r = subprocess.run(serve_cmd("--runner", "simulated"), env={**env(), "MAGNITUDE_AUTH_MODE": "apiKeys"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--api-keys-file" in r.stderr


def test_serve_reads_the_auth_mode_and_keys_file_from_the_environment(tmp_path: Path) -> None:
    """What the operator wires: MAGNITUDE_AUTH_MODE and MAGNITUDE_API_KEYS_FILE."""
    path = tmp_path / "keys.yaml"
    path.write_text(two_tenants())
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        serve_cmd("--runner", "simulated", "--cost-model", "unit", "--time-scale", "0.001", "--port", str(port)),
        env={**env(), "MAGNITUDE_AUTH_MODE": "apiKeys", "MAGNITUDE_API_KEYS_FILE": str(path)},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        wait_ready(url, proc, 60)
        ok = openai.OpenAI(base_url=url + "/v1", api_key=KEY_ACME, max_retries=0).chat.completions.create(
            model="simulated", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert ok.choices[0].finish_reason == "length"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="unknown-key-0123456789", max_retries=0).models.list()
    finally:
        proc.terminate()
        proc.wait(30)
