"""The layering of `deploy` and `cluster` (issue 9): the manifest schema depends on neither;
`cluster` uses `deploy` only for the manifest (and the `baton` entry point, cluster/cli.py,
for the deploy commands it offers); in `deploy` only the client module uses `cluster`, and only
once a command connects; no module imports itself back through the others."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cluster", "deploy")


def imports() -> dict[str, set[str]]:
    """Every module of PACKAGES -> the modules of PACKAGES it imports anywhere (at the top,
    inside functions, or for type checking)."""
    graph: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            graph[module] = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                graph[module] |= {n for n in names if n.split(".")[0] in PACKAGES}
    for module, targets in graph.items():  # `from deploy import client` names a module
        graph[module] = {t for t in targets if t in graph and t != module}
    return graph


def test_deploy_uses_cluster_only_through_the_client_and_cluster_only_the_manifest():
    graph = imports()
    assert graph["deploy.manifest"] == set()
    for module, targets in graph.items():
        if module.startswith("deploy.") and module != "deploy.client":
            assert not {t for t in targets if t.startswith("cluster")}, module
        if module.startswith("cluster.") and module != "cluster.deploy_command":
            assert {t for t in targets if t.startswith("deploy")} <= {"deploy.manifest"}, module
    assert {t for t in graph["deploy.client"] if t.startswith("cluster")} == {"cluster.controller"}


def test_no_import_cycle():
    graph = imports()
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, " -> ".join((*path, module))
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, (*path, module))
        done.add(module)

    for module in graph:
        visit(module, ())


def test_importing_the_deploy_commands_loads_no_cluster_module_and_no_ray():
    code = (
        "import sys, deploy.commands; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cluster', 'ray', 'torch')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert out.stdout.strip() == "[]"
