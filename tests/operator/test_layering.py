"""The operator's layering (DESIGN §4, §5.9-10): pure policy stays pure, one module talks to the
API, Kopf stays in the handlers, and nothing reaches into the engine, runner or server."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from opkit import ROOT

PKG = ROOT / "operator" / "magnitude" / "operator"
MODULES = sorted(p for p in PKG.glob("*.py") if p.name != "__init__.py")

PURE = {"spec", "crd", "naming", "servicever", "desired", "plan", "status", "validation", "autoscaler"}
IO_LIBS = {"kopf", "kubernetes", "prometheus_client", "httpx", "torch", "fastapi", "requests", "urllib3", "socket"}
ONLY_IN = {"kubernetes": {"apply"}, "kopf": {"handlers", "main"}, "prometheus_client": {"scrape"}}


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


@pytest.mark.parametrize("path", MODULES, ids=[p.stem for p in MODULES])
def test_module_layering(path: Path) -> None:
    mods = imports(path)
    roots = {m.split(".")[0] for m in mods}
    assert not any(m.startswith(("magnitude.engine", "magnitude.runner", "magnitude.server")) for m in mods), mods
    if path.stem in PURE:
        assert not roots & IO_LIBS, f"{path.stem} is pure policy but imports {roots & IO_LIBS}"
    for lib, allowed in ONLY_IN.items():
        if lib in roots:
            assert path.stem in allowed, f"only {allowed} may import {lib}"


def test_every_module_says_what_it_owns() -> None:
    for path in MODULES:
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc and len(doc) > 30, f"{path.name} needs a module docstring"
