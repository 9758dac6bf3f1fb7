"""recordTrace / `magnitude serve --record-trace`: a real uvicorn server writes the traffic a stock
openai client sends as a simulator trace, and `magnitude simulate` replays it (prefix groups
become prefix-cache hits). The simulated runner stands in for the model's speed and tokenizer
only; HTTP, admission, the engine loop and the writer thread are the real ones. Rotation, tenant
hashing, text and write failures are tested on the recorder itself."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from magnitude.cli.main import main
from magnitude.policy.schema import EngineConfig, RecordTracePolicy
from magnitude.sim.cost import LinearCost
from magnitude.sim.simulate import simulate
from magnitude.sim.trace import TraceRecord, load_trace, prefix_token_ids
from magnitude.server.trace_recorder import Ended, TraceRecorder, TraceRecordError, prefix_groups, tenant_hash

from .conftest import serve, sim_config, simulated

SYSTEM = "You are a careful assistant. " * 8  # about 230 bytes: several full 16-token blocks


def recording_config(path: Path, **record: object) -> EngineConfig:
    config = sim_config()
    return config.model_copy(update={"record_trace": RecordTracePolicy(path=str(path), **record)})


def test_a_real_server_records_a_trace_that_simulate_replays(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "live.jsonl"
    config = recording_config(path)
    with serve(simulated(config), config) as s:
        c = openai.OpenAI(base_url=s.v1, api_key="unused", max_retries=0)
        for i, user in enumerate(["alice", "alice", "bob"]):
            c.chat.completions.create(
                model="simulated", max_tokens=3 + i, user=user,
                messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {i}"}],
                extra_body={"priority_class": "interactive" if user == "alice" else "batch"},
            )
        # A client that leaves mid-stream: recorded as cancelled, with its cancel time.
        with httpx.stream("POST", s.v1 + "/chat/completions", json={
            "model": "simulated", "max_tokens": 2000, "stream": True, "user": "carol",
            "messages": [{"role": "user", "content": "a long answer please"}],
        }) as r:
            next(r.iter_lines())
        deadline = time.monotonic() + 10
        while s.engine.num_tracked and time.monotonic() < deadline:
            time.sleep(0.01)
        s.engine.trace_recorder.flush()
        live = load_trace(path)  # written while serving, not only at shutdown
        assert len(live) == 4
    records = {r.id: r for r in load_trace(path)}
    assert len(records) == 4
    text = path.read_text()
    assert "alice" not in text and "question" not in text and "careful" not in text  # hashed, no text
    by_tenant: dict[str | None, list[TraceRecord]] = {}
    for r in sorted(records.values(), key=lambda r: r.arrival):
        by_tenant.setdefault(r.tenant, []).append(r)
    alice, bob, carol = by_tenant[tenant_hash("alice")], by_tenant[tenant_hash("bob")], by_tenant[tenant_hash("carol")]
    assert [r.output_tokens for r in alice + bob] == [3, 4, 5]  # the simulated runner never stops early
    assert {r.priority_class for r in alice} == {"interactive"} and bob[0].priority_class == "batch"
    assert all(r.preparation is not None and r.preparation >= 0 for r in records.values())
    # alice's two prompts share their leading blocks (the system prompt); bob's are his own (another
    # isolation key: the engine would not share cached blocks across tenants either).
    a0, a1 = alice[0].prefix_groups, alice[1].prefix_groups
    assert a0 and a1 and a0[:3] == a1[:3]
    assert not set(bob[0].prefix_groups or []) & set(a0)
    assert carol[0].cancel_at is not None and carol[0].cancel_at >= carol[0].arrival
    assert carol[0].output_tokens >= 2

    assert main(["simulate", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["summary"]["requests"] == 4 and report["summary"]["finished"] == 3
    assert report["summary"]["cancelled"] == 1

    # Prefix groups are prefix-cache hits in the replay: alice's second prompt prefills less than its length.
    result = simulate(list(records.values()), EngineConfig(), LinearCost())
    second = next(req for rec, req in result.requests if rec.id == alice[1].id)
    assert second.num_cached_tokens >= 3 * 16


def ended(i: int, tenant: str = "acme", tokens: list[int] | None = None, status: str = "finished") -> Ended:
    return Ended(f"r{i}", 100.0 + i, 100.2 + i, tokens or list(range(40)), 5, "standard", tenant, status,
                 101.0 + i, None, f"m|{tenant}", {"expected_output_tokens": 7})


def test_rotation_keeps_files_bounded_and_each_one_a_trace(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rec = TraceRecorder(RecordTracePolicy(path=str(path), maxBytes=1024, keep=2), 100.0, 16)
    for i in range(60):
        rec.record(ended(i))
    rec.close()
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files] == ["t.jsonl", "t.jsonl.1", "t.jsonl.2"]
    assert all(f.stat().st_size <= 1024 for f in files)
    kept = [r for f in files for r in load_trace(f)]
    assert len(kept) < 60 and rec.written == 60  # the oldest files were dropped
    newest = max(int(r.id[1:]) for r in load_trace(path))
    assert newest == 59 and all(int(r.id[1:]) < int(load_trace(path)[0].id[1:]) for r in load_trace(files[1]))


def test_tenant_hashing_text_and_status_rules(tmp_path: Path) -> None:
    plain = TraceRecorder(RecordTracePolicy(path=str(tmp_path / "a"), hashTenants=False, includeText=True), 100.0, 16,
                          detokenize=lambda ids: f"<{len(ids)} tokens>")
    r = plain.to_record(ended(1, tenant="acme"))
    assert r.tenant == "acme" and r.prompt == "<40 tokens>" and r.arrival == pytest.approx(1.0)
    assert r.preparation == pytest.approx(0.2) and r.prefix_block_size == 16 and len(r.prefix_groups) == 2
    hashed = TraceRecorder(RecordTracePolicy(path=str(tmp_path / "b")), 100.0, 16)
    h = hashed.to_record(ended(1, tenant="acme"))
    assert h.tenant == tenant_hash("acme") == hashed.to_record(ended(2, tenant="acme")).tenant
    assert h.tenant != tenant_hash("acme2") and h.prompt is None
    cancelled = hashed.to_record(ended(3, status="cancelled"))
    assert cancelled.cancel_at == pytest.approx(4.0) and cancelled.output_tokens == 7  # the estimate, not the 5 so far
    assert hashed.to_record(ended(4, status="rejected")).cancel_at is None
    plain.close()
    hashed.close()


def test_a_write_failure_drops_records_and_never_raises(tmp_path: Path) -> None:
    d = tmp_path / "gone"
    d.mkdir()
    rec = TraceRecorder(RecordTracePolicy(path=str(d / "t.jsonl")), 0.0, 16)
    rec.record(ended(1))
    rec.flush()
    (d / "t.jsonl").unlink()
    d.rmdir()
    rec._file.close()  # the disk goes away under the open file: the next write fails
    rec._file = None
    for i in range(3):
        rec.record(ended(10 + i))  # never raises on the caller's (the engine loop's) thread
    rec.flush()
    assert rec.written == 1 and rec.write_errors == 3 and rec.dropped == 3
    rec.close()
    with pytest.raises(TraceRecordError, match="recordTrace.path .*does not exist"):
        TraceRecorder(RecordTracePolicy(path=str(tmp_path / "nowhere" / "t.jsonl")), 0.0, 16)


def test_recording_does_not_wait_for_the_disk(tmp_path: Path) -> None:
    rec = TraceRecorder(RecordTracePolicy(path=str(tmp_path / "t.jsonl")), 0.0, 16)
    gate = threading.Event()
    original = rec._write
    rec._write = lambda data: (gate.wait(10), original(data))  # a disk that hangs
    rec.record(ended(1))
    for i in range(100):  # returns at once although the writer is stuck
        rec.record(ended(2 + i))
    assert rec.written == 0
    gate.set()
    rec.close()
    assert rec.written == 101


def test_prefix_groups_are_shared_exactly_as_far_as_prompts_agree() -> None:
    shared = list(range(64))
    a = prefix_groups(shared + [1] * 64, 16, "k")  # 8 full blocks: points at 1, 2, 4, 8
    b = prefix_groups(shared + [2] * 64, 16, "k")
    assert len(a) == 4 and a[:3] == b[:3] and a[3] != b[3]
    assert prefix_groups(shared, 16, "other")[0] != a[0]  # another isolation key shares nothing
    ra = TraceRecord(id="a", arrival=0, prompt_tokens=128, output_tokens=1, prefix_groups=a, prefix_block_size=16)
    rb = TraceRecord(id="b", arrival=0, prompt_tokens=100, output_tokens=1, prefix_groups=b, prefix_block_size=16)
    ta, tb = prefix_token_ids(ra), prefix_token_ids(rb)
    assert len(ta) == 128 and len(tb) == 100 and ta[:64] == tb[:64] and ta[64:100] != tb[64:100]
    with pytest.raises(ValueError, match="prefix_groups and prefix_block_size go together"):
        TraceRecord(id="c", arrival=0, prompt_tokens=1, output_tokens=1, prefix_groups=a)
