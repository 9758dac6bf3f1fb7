"""`magnitude operator`: run the ModelService operator (Kopf) against the current cluster."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from magnitude.operator.main import build_parser

    build_parser(parser)


def run(args: argparse.Namespace) -> int:
    from magnitude.operator.main import run as run_operator

    return run_operator(args)
