"""Starting the operator process: namespaces to watch, liveness endpoint, logging."""

from __future__ import annotations

import argparse
import logging
import os

WATCH_NAMESPACES_ENV = "MAGNITUDE_WATCH_NAMESPACES"


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="magnitude operator", description="Run the ModelService operator.")
    p.add_argument("--namespace", "-n", action="append", default=[],
                   help=f"namespace to watch (repeatable; default: ${WATCH_NAMESPACES_ENV}, comma-separated, "
                        "or all namespaces)")
    p.add_argument("--liveness", default=None, help="serve Kopf's liveness probe, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--verbose", action="store_true")
    return p


def run(args: argparse.Namespace) -> int:
    import kopf

    import magnitude.operator.handlers  # noqa: F401  (registers the handlers)

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    namespaces = list(args.namespace) or [
        ns.strip() for ns in os.environ.get(WATCH_NAMESPACES_ENV, "").split(",") if ns.strip()]
    kopf.run(clusterwide=not namespaces, namespaces=namespaces, standalone=True,
             liveness_endpoint=args.liveness)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))
