"""The simulator's model of speculative decoding (sim/speculation.py): acceptance draws against the
geometric expectation, per-class acceptance, draft cost by method, seeded reproducibility, modes
on/off/auto through the engine's own policy object, and `magnitude simulate`'s knobs, comparison
and refusals."""

from __future__ import annotations

import json

import pytest

from magnitude.cli.main import main
from magnitude.engine.speculation import SpeculationPolicy
from magnitude.policy.load import resolve_config
from magnitude.sim.cost import LinearCost, UnitCost
from magnitude.sim.report import build_report
from magnitude.sim.simulate import simulate
from magnitude.sim.speculation import SpecConfigError, SpecModel, expected_tokens_per_step, spec_simulation
from magnitude.sim.trace import TraceRecord

K = 4


def records(n: int = 40, output: int = 60, classes: tuple[str, ...] = ("standard",),
            spacing: float = 0.05) -> list[TraceRecord]:
    return [TraceRecord(id=f"r{i}", arrival=i * spacing, prompt_tokens=32, output_tokens=output,
                        priority_class=classes[i % len(classes)]) for i in range(n)]


def config(mode: str = "on", method: str = "ngram", *extra: str):
    sets = [f"draftModel.method={method}", f"draftModel.numSpeculativeTokens={K}", f"draftModel.mode={mode}",
            "scheduler.tokenBudget=512", "kvCache.numBlocks=2048"]
    if method == "draft":
        sets.append("draftModel.source=some/draft")
    return resolve_config(None, [*sets, *extra])


@pytest.mark.parametrize("a", [0.0, 0.3, 0.7, 0.95, 1.0])
def test_mean_tokens_per_step_follow_the_geometric_expectation(a: float) -> None:
    result = simulate(records(), config("on"), UnitCost(), keep_events=False, speculation=SpecModel(a, seed=5))
    sp = result.speculation
    assert sp is not None and sp["proposed"] > 0
    want = expected_tokens_per_step(a, K)
    # ~800 drafted decodes; a few are capped below K near max_tokens, which only lowers the mean
    assert sp["tokens_per_step"] == pytest.approx(want, abs=0.1 + 0.05 * want), (sp, want)
    assert all(req.num_output_tokens == 60 for _, req in result.requests)


def test_expected_tokens_formula() -> None:
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens_per_step(0.9, 0) == 1.0


def test_acceptance_per_priority_class() -> None:
    recs = records(classes=("interactive", "batch"))
    model = SpecModel(0.5, {"interactive": 1.0, "batch": 0.0})
    result = simulate(recs, config("on"), UnitCost(), keep_events=False, speculation=model)
    by_class = {c: [req for _, req in result.requests if req.priority_class == c] for c in ("interactive", "batch")}
    assert all(r.spec_accepted == r.spec_proposed > 0 for r in by_class["interactive"])
    assert all(r.spec_accepted == 0 and r.spec_proposed > 0 for r in by_class["batch"])
    # all-accepted requests finish in about a fifth of the steps
    steps = lambda r: r.finish_time - r.first_token_time  # noqa: E731 - unit cost: times are step counts
    assert max(steps(r) for r in by_class["interactive"]) < min(steps(r) for r in by_class["batch"]) / 3


def test_runs_are_reproducible_and_seeded() -> None:
    def run(seed: int) -> dict:
        r = simulate(records(), config("auto"), LinearCost(), speculation=SpecModel(0.6, seed=seed))
        return build_report(r)

    assert run(1) == run(1)
    assert run(1)["speculation"] != run(2)["speculation"]


def test_draft_cost_by_method() -> None:
    # one record: every step is one sequence; unit cost: a step is 1.0 plus the draft forwards
    one = records(n=1, output=20)
    ngram = simulate(one, config("on"), UnitCost(), speculation=SpecModel(0.0))
    assert {s.duration for s in ngram.steps} == {1.0}  # prompt lookup: free to propose
    draft = simulate(one, config("on", "draft"), UnitCost(), speculation=SpecModel(0.0, draft_step_seconds=0.25))
    durations = [s.duration for s in draft.steps]
    assert durations[0] == 1.0  # the prefill step drafts nothing
    assert set(durations[1:-K]) == {1.0 + K * 0.25}  # one draft forward per lookahead position
    assert durations[-K:] == [1.0 + k * 0.25 for k in range(K - 1, -1, -1)]  # lookahead capped by max_tokens
    assert draft.speculation["draft_seconds"] == pytest.approx(sum(d - 1.0 for d in durations))


def test_modes_and_auto_uses_the_engines_policy() -> None:
    # arrivals far enough apart that most steps are decode-only (the policy measures only those)
    recs = records(spacing=0.4)
    # an expensive draft model with low acceptance: speculation loses
    model = SpecModel(0.1, draft_step_seconds=0.01)
    results = {m: simulate(recs, config(m, "draft"), LinearCost(), keep_events=False, speculation=model)
               for m in ("off", "on", "auto")}
    sp = {m: r.speculation for m, r in results.items()}
    assert sp["off"]["proposed"] == 0 and sp["on"]["proposed"] > 0
    assert sp["auto"]["switches"] >= 1 and sp["auto"]["proposed"] < sp["on"]["proposed"] / 3
    e2e = {m: build_report(r)["summary"]["e2e"]["p50"] for m, r in results.items()}
    assert e2e["on"] > e2e["off"] and e2e["auto"] < e2e["on"]
    sim = spec_simulation(config("auto"), LinearCost(), model.__class__(0.5), {})
    assert isinstance(sim.policy, SpeculationPolicy) and sim.policy.mode == "auto"


def test_knobs_and_config_must_agree() -> None:
    with pytest.raises(SpecConfigError, match="no draftModel"):
        spec_simulation(resolve_config(None, []), UnitCost(), SpecModel(0.5), {})
    with pytest.raises(SpecConfigError, match="--spec-acceptance"):
        spec_simulation(config(), UnitCost(), None, {})
    with pytest.raises(SpecConfigError, match="--spec-draft-seconds"):
        spec_simulation(config("on", "draft"), UnitCost(), SpecModel(0.5), {})
    with pytest.raises(SpecConfigError, match="method draft only"):
        spec_simulation(config(), UnitCost(), SpecModel(0.5, draft_step_seconds=0.1), {})
    with pytest.raises(SpecConfigError, match="within 0..1"):
        SpecModel(1.5)
    assert spec_simulation(resolve_config(None, []), UnitCost(), None, {}) is None


def _trace(tmp_path) -> str:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"id": r.id, "arrival": r.arrival, "prompt_tokens": r.prompt_tokens,
                                        "output_tokens": r.output_tokens, "priority_class": r.priority_class}) + "\n"
                            for r in records(n=10, output=30)))
    return str(path)


SPEC_SETS = ["--set", "draftModel.method=ngram", "--set", f"draftModel.numSpeculativeTokens={K}"]


def test_cli_compares_off_on_auto_side_by_side(tmp_path, capsys) -> None:
    trace = _trace(tmp_path)
    assert main(["simulate", trace, *SPEC_SETS, "--spec-acceptance", "0.8", "--compare-speculation"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["mode", "tokens/s", "TTFT"]
    assert [line.split()[0] for line in lines[1:4]] == ["off", "on", "auto"]
    assert main(["simulate", trace, *SPEC_SETS, "--spec-acceptance", "0.8", "--spec-acceptance", "batch=0.1",
                 "--compare-speculation", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"off", "on", "auto"} and doc["off"]["speculation"]["proposed"] == 0
    assert doc["on"]["speculation"]["acceptance"] > 0.5
    assert main(["simulate", trace, *SPEC_SETS, "--spec-acceptance", "0.8"]) == 0
    assert "speculation ngram k=4 mode auto: acceptance" in capsys.readouterr().out


def _bad(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(("extra", "expected"), [
    (SPEC_SETS, "draftModel: give the acceptance to simulate (--spec-acceptance"),
    (["--spec-acceptance", "0.5"], "--spec-acceptance / --spec-draft-seconds: the config has no draftModel"),
    ([*SPEC_SETS, "--spec-acceptance", "lots"], "--spec-acceptance lots: expected A or CLASS=A"),
    ([*SPEC_SETS, "--spec-acceptance", "1.5"], "acceptance must be within 0..1"),
    ([*SPEC_SETS, "--spec-acceptance", "batch=0.5"], "--spec-acceptance A: give the acceptance of every class"),
    ([*SPEC_SETS, "--spec-acceptance", "0.5", "--spec-draft-seconds", "0.1"], "applies to draftModel.method draft only"),
    (["--compare-speculation"], "--compare-speculation: the config has no draftModel"),
    ([*SPEC_SETS, "--spec-acceptance", "0.5", "--compare-speculation", "--report", "out"], "writes no --report"),
])
def test_cli_refusals_name_the_flag(tmp_path, capsys, extra, expected) -> None:
    assert expected in _bad(capsys, ["simulate", _trace(tmp_path), *extra])
