"""`magnitude crd`: print the ModelService CRD YAML (what `crds/modelservice.yaml` holds)."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options: the CRD has one source


def run(args: argparse.Namespace) -> int:
    from magnitude.operator.crd import render

    sys.stdout.write(render())
    return 0
