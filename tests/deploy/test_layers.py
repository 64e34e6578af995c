"""The package layering: every import, at the top of a module, inside a function or for type
checking, points down the layers (or stays in its own package); the `baton` command table's
modules count as imports of baton/cli.py. Nothing imports `benchmarks` but `tests`, nothing
imports `tests`. Within the layers, the manifest schema depends on no other module of
`deploy` or `cluster`, `cluster` uses `deploy` only for the manifest (and cluster/
deploy_command.py for the deploy commands it runs), and no module imports itself back through
the others."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from baton.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
# Bottom to top; a package may import only packages of lower layers (and itself).
LAYERS = (
    ("engine",),
    ("kvtransfer",),
    ("prefill_worker", "decode_worker"),
    ("router",),
    ("deploy",),
    ("cluster",),
    ("perf",),
    ("baton",),
    ("benchmarks",),
    ("tests",),
)
LAYER_OF = {package: i for i, layer in enumerate(LAYERS) for package in layer}


def imports() -> dict[str, set[str]]:
    """Every module of every package -> the dotted names it imports anywhere in its file (at
    the top, inside functions, or for type checking), of any package of LAYERS."""
    graph: dict[str, set[str]] = {}
    for package in LAYER_OF:
        for path in sorted((ROOT / package).rglob("*.py")):
            # a package's __init__ is "pkg.__init__": `from pkg import mod` is an edge to pkg.mod
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            graph[module] = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                graph[module] |= {n for n in names if n.split(".")[0] in LAYER_OF}
    graph["baton.cli"] |= {c.module for c in COMMANDS}
    return graph


def module_graph() -> dict[str, set[str]]:
    """imports() narrowed to modules (`from deploy import client` names one), self excluded."""
    graph = imports()
    return {m: {t for t in targets if t in graph and t != m} for m, targets in graph.items()}


def test_the_walk_sees_function_level_imports():
    graph = imports()
    # cluster/cli.py imports cluster.controller inside run_one_line only
    assert "cluster.controller" in graph["cluster.cli"]
    assert {"perf.bench.command", "perf.planner", "cluster.deploy_command"} <= graph["baton.cli"]


def test_every_import_points_down_the_layers():
    wrong = []
    for module, targets in imports().items():
        package = module.split(".")[0]
        for target in targets:
            other = target.split(".")[0]
            if other != package and LAYER_OF[other] >= LAYER_OF[package]:
                wrong.append(f"{module} imports {target}")
    assert wrong == []


def test_no_product_package_imports_benchmarks_or_tests():
    product = {p for p in LAYER_OF if LAYER_OF[p] < LAYER_OF["benchmarks"]}
    assert len(product) == 9 and {"engine", "perf", "baton"} <= product
    for module, targets in imports().items():
        if module.split(".")[0] in product:
            assert not {t for t in targets if t.split(".")[0] in ("benchmarks", "tests")}, module


def test_deploy_imports_no_cluster_and_cluster_only_the_manifest():
    graph = module_graph()
    assert {t for t in graph["deploy.manifest"] if t.startswith(("deploy", "cluster"))} == set()
    for module, targets in graph.items():
        if module.startswith("deploy"):
            assert not {t for t in targets if t.startswith("cluster")}, module
        if module.startswith("cluster") and module != "cluster.deploy_command":
            assert {t for t in targets if t.startswith("deploy")} <= {"deploy.manifest"}, module
    assert {t for t in graph["cluster.deploy_command"] if t.startswith("deploy.")} == {
        "deploy.client",
        "deploy.commands",
    }


def test_no_import_cycle():
    graph = module_graph()
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


def loaded_after(statement: str) -> list[str]:
    """The modules of cluster, ray and torch a fresh interpreter holds after `statement`."""
    code = (
        f"import sys; {statement}; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cluster', 'ray', 'torch')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    return eval(out.stdout)  # noqa: S307 - a list of module names printed by ourselves


def test_importing_the_deploy_commands_loads_no_cluster_module_and_no_ray():
    assert loaded_after("import deploy.commands") == []


def test_the_deploy_command_loads_the_controller_only_once_a_cluster_answers():
    loaded = loaded_after("import cluster.deploy_command")
    assert "cluster.controller" not in loaded
    assert not [m for m in loaded if m.split(".")[0] in ("ray", "torch")]
