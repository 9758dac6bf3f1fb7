"""The engine loop thread with the real Scheduler: idle sleep, cancellation at the next step."""

from __future__ import annotations

import threading
import time
from typing import Any

from magnitude.engine.output import RunnerOutput, SampledToken, StepPlan
from magnitude.engine.request import Request
from magnitude.engine.sampling import SamplingParams
from magnitude.engine.scheduler import Scheduler
from magnitude.policy.schema import EngineConfig
from magnitude.server.engine_loop import EngineLoop, StepStats


class GatedRunner:
    """Returns token 7 for every sampling sequence; the first step waits for `gate`."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> RunnerOutput:
        self.plans.append(plan)
        if len(self.plans) == 1:
            self.entered.set()
            self.gate.wait(5)
        return RunnerOutput({s.request_id: [SampledToken(7)] for s in plan.seqs if s.sample}, duration_s=0.001)


class Recorder:
    def __init__(self) -> None:
        self.stats: list[StepStats] = []
        self.updates: list[Any] = []
        self.dead: BaseException | None = None

    def after_step(self, plan: Any, output: Any, updates: list[Any], stats: StepStats) -> None:
        self.stats.append(stats)
        self.updates.extend(updates)

    def on_dead(self, exc: BaseException) -> None:
        self.dead = exc


def request(rid: str, max_tokens: int = 50) -> Request:
    return Request(rid, [1, 2, 3, 4, 5], 5, SamplingParams(max_tokens=max_tokens, temperature=0.0), time.monotonic())


def wait_for(cond: Any, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.005)
    raise AssertionError("condition not reached")


def test_abort_during_a_step_takes_effect_at_the_next_step() -> None:
    scheduler = Scheduler(EngineConfig(), num_blocks=64)
    runner, rec = GatedRunner(), Recorder()
    loop = EngineLoop(scheduler, runner, rec)
    loop.start()
    try:
        assert loop.add_request(request("a")).accepted
        assert loop.add_request(request("b", max_tokens=3)).accepted
        assert runner.entered.wait(5)
        loop.abort("a")
        runner.gate.set()
        wait_for(lambda: not scheduler.has_work())
        later = runner.plans[1:]
        assert later and all(s.request_id != "a" for p in later for s in p.seqs)
        assert scheduler.stats().kv_used_blocks == 0
        finished = [u for u in rec.updates if u.finished]
        assert [u.request_id for u in finished] == ["b"] and finished[0].finish_reason == "length"
        # Idle: the loop sleeps instead of spinning.
        steps = loop.steps
        time.sleep(0.2)
        assert loop.steps == steps and loop.running
    finally:
        loop.stop()
    assert rec.dead is None


def test_scheduler_exception_marks_the_loop_dead() -> None:
    class Broken(Scheduler):
        def schedule(self, now: float) -> StepPlan:
            raise RuntimeError("invariant violated")

    rec = Recorder()
    loop = EngineLoop(Broken(EngineConfig(), num_blocks=8), GatedRunner(), rec)
    loop.start()
    loop.add_request(request("x"))
    wait_for(lambda: rec.dead is not None)
    assert not loop.running and isinstance(loop.dead, RuntimeError)
