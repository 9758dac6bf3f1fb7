"""`magnitude trace SCENARIO`: write a seeded scenario trace (JSONL) to stdout or `-o FILE`."""

from __future__ import annotations

import argparse

from magnitude.cli.errors import UsageError
from magnitude.sim.scenarios import SCENARIOS, ScenarioOptions, generate
from magnitude.sim.trace import write_trace


def _positive(kind: type):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return v

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenario", choices=sorted(SCENARIOS), help="which scenario")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--n", type=_positive(int), default=None, help="number of requests")
    p.add_argument("--duration", type=_positive(float), default=None, help="seconds of arrivals")
    p.add_argument("--rate", type=_positive(float), default=None, help="arrivals per second")
    p.add_argument("-o", "--output", default=None, help="output file (default: stdout)")


def run(args: argparse.Namespace) -> int:
    records = generate(args.scenario, ScenarioOptions(args.seed, args.n, args.duration, args.rate))
    try:
        write_trace(records, args.output)
    except OSError as e:
        raise UsageError(f"-o {args.output}: {e.strerror or e}") from e
    return 0
