"""The layout DESIGN §4 fixes: a PEP 420 namespace `magnitude` whose every subpackage is listed in
pyproject.toml, and the layering rules, checked on the source (AST, imports inside functions too)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONTAINERS = ("server", "operator")


def package_dirs() -> dict[str, str]:
    found = {}
    for container in CONTAINERS:
        base = ROOT / container / "magnitude"
        for init in base.rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(ROOT / container)
            found[".".join(rel.parts)] = str(init.parent.relative_to(ROOT))
    return found


def test_pyproject_lists_exactly_the_packages_on_disk() -> None:
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = package_dirs()
    assert sorted(tool["packages"]) == sorted(on_disk)
    assert tool["package-dir"] == on_disk


def test_namespace_roots_have_no_init() -> None:
    for container in CONTAINERS:
        assert not (ROOT / container / "__init__.py").exists(), f"{container}/__init__.py shadows a module"
        assert not (ROOT / container / "magnitude" / "__init__.py").exists(), "magnitude must stay a namespace"


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def sources(*folders: str) -> list[Path]:
    files = [p for f in folders for p in (ROOT / f).rglob("*.py") if "__pycache__" not in p.parts]
    assert files, f"no sources under {folders}"
    return files


HEAVY = ("torch", "transformers", "fastapi", "starlette", "uvicorn", "kopf", "kubernetes", "prometheus_client")


def _hits(path: Path, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(m for m in imports_of(path) if any(m == f or m.startswith(f + ".") for f in forbidden))


@pytest.mark.parametrize("path", sources("server/magnitude/engine", "server/magnitude/policy"), ids=lambda p: p.name)
def test_pure_policy_imports_no_framework(path: Path) -> None:
    forbidden = HEAVY + ("magnitude.runner", "magnitude.server", "magnitude.sim", "magnitude.operator", "magnitude.cli")
    assert _hits(path, forbidden) == []


@pytest.mark.parametrize("path", sources("operator/magnitude/operator"), ids=lambda p: p.name)
def test_operator_never_imports_the_engine(path: Path) -> None:
    assert _hits(path, ("magnitude.engine", "magnitude.runner", "magnitude.server", "torch")) == []


@pytest.mark.parametrize("path", sources("server/magnitude/sim"), ids=lambda p: p.name)
def test_simulator_imports_no_runner_or_server(path: Path) -> None:
    # It drives the engine's Scheduler; the model and HTTP stay out.
    assert _hits(path, HEAVY + ("magnitude.runner", "magnitude.server")) == []


def test_auth_decision_imports_no_framework() -> None:
    """Who the tenant is (server/auth.py) is decided without FastAPI, so it is testable as functions."""
    assert _hits(ROOT / "server/magnitude/server/auth.py", HEAVY + ("magnitude.runner", "magnitude.engine")) == []


def test_operator_autoscaler_is_pure() -> None:
    """The autoscaler and every operator module it imports (followed transitively) do no I/O."""
    forbidden = HEAVY + ("httpx", "asyncio", "magnitude.engine", "magnitude.runner", "magnitude.server")
    todo, seen = ["magnitude.operator.autoscaler"], set()
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        path = ROOT / "operator" / (mod.replace(".", "/") + ".py")
        assert _hits(path, forbidden) == [], path.name
        todo += [m for m in imports_of(path) if m.startswith("magnitude.operator.")]
    assert "magnitude.operator.spec" in seen  # the walk really followed the autoscaler's imports
