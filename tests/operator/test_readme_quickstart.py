"""README's cluster quickstart says only true things about this tree: the first two commands stay
`make run` and `make test`; every file the quickstart builds, installs or applies exists; every
`--set` names a value the chart has; the ModelService it waits for and port-forwards to is the
one the applied example creates (the operator names the Service after it)."""

from __future__ import annotations

import re

import yaml

from opkit import ROOT

README = (ROOT / "README.md").read_text()


def code_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, re.S)


def test_first_two_commands_stay_first() -> None:
    first = [line.split("#")[0].strip() for line in code_blocks(README)[0].splitlines() if line.strip()]
    assert first[:2] == ["make run", "make test"], first


def test_cluster_quickstart_matches_the_tree() -> None:
    section = README.split("## On your cluster", 1)[1].split("\n## ", 1)[0]
    [block] = code_blocks(section)
    for path in re.findall(r"-f (\S+)", block):
        assert (ROOT / path).is_file(), path
    assert (ROOT / "charts" / "magnitude" / "Chart.yaml").is_file() and "helm install magnitude charts/magnitude" in block
    values = yaml.safe_load((ROOT / "charts" / "magnitude" / "values.yaml").read_text())
    for key in re.findall(r"--set ([\w.]+)=", block):
        node = values
        for part in key.split("."):
            assert isinstance(node, dict) and part in node, f"--set {key}: no such chart value"
            node = node[part]
    [example] = re.findall(r"kubectl apply -f (examples/\S+)", block)
    [service] = [d for d in yaml.safe_load_all((ROOT / example).read_text()) if d and d["kind"] == "ModelService"]
    name = service["metadata"]["name"]
    assert f"kubectl get msvc {name}" in block and f"svc/{name} 8000:8000" in block
    for mentioned in re.findall(r"examples/[\w./-]+\.yaml", section):
        assert (ROOT / mentioned).is_file(), mentioned
