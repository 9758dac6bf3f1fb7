"""The `magnitude` console script: a registry of subcommands, each imported only when chosen.

A command is a module with `run(args) -> int` and either `add_arguments(parser)` or
`add_parser(subparsers) -> parser`. Registering one is a
line in `COMMANDS`; `magnitude simulate` therefore never imports torch, kopf or FastAPI, and a
command whose module (or its dependencies) is missing fails alone, with exit code 2.
Bad input raises `UsageError` (or a `ConfigError`): printed as `magnitude CMD: error: ...`, exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

from magnitude.cli.errors import EXIT_USAGE, UsageError
from magnitude.policy.load import ConfigError

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("magnitude.cli.serve", "serve the OpenAI-compatible API"),
    "simulate": ("magnitude.cli.simulate", "replay a JSONL trace through the scheduler on a virtual clock"),
    "trace": ("magnitude.cli.trace", "write a trace for a named scenario"),
    "profile": ("magnitude.cli.profile", "measure the real runner's step times for the simulator"),
    "operator": ("magnitude.cli.operator", "run the Kubernetes operator"),
    "crd": ("magnitude.cli.crd", "print the ModelService CRD YAML"),
}


def _load(name: str) -> ModuleType:
    module, _ = COMMANDS[name]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise UsageError(f"this install cannot run `{name}` ({e})") from e


def build_parser(chosen: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="magnitude", description="Magnitude: LLM serving engine and operator.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, help_text) in COMMANDS.items():
        if name != chosen:
            sub.add_parser(name, help=help_text, description=help_text)
            continue
        mod = _load(name)
        if hasattr(mod, "add_parser"):  # the module builds its own subparser
            p = mod.add_parser(sub)
        else:
            p = sub.add_parser(name, help=help_text, description=help_text)
            mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    if chosen not in COMMANDS:
        chosen = None
    try:
        parser = build_parser(chosen)
        args = parser.parse_args(argv)
        return int(args._run(args) or 0)
    except (UsageError, ConfigError) as e:
        print(f"magnitude {chosen or ''}: error: {e}".replace("  ", " "), file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
