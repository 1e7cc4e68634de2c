"""The package layers (docs/architecture.md): planner.spec and planner.mesh at the bottom, the
simulator above them, the planner's search above the simulator, the runtime beside it and the
apps on top. Read from the source with `ast`, every import counted, also those inside
functions, so a lazy import cannot hide a loop.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("planner", "simulator", "runtime", "apps")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> nx.DiGraph:
    modules = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pkg import mod` imports the module pkg.mod when there is one
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                           else node.module for a in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] in PACKAGES and target != name:
                    while target not in modules and "." in target:
                        target = target.rsplit(".", 1)[0]
                    graph.add_edge(name, target)
    return graph


GRAPH = _import_graph()


def _imports_of(prefix: str) -> list[tuple[str, str]]:
    return [(a, b) for a, b in GRAPH.edges if a == prefix or a.startswith(prefix + ".")]


@pytest.mark.parametrize("package", ["simulator", "planner"])
def test_models_never_import_the_runtime_or_the_apps(package):
    bad = [(a, b) for a, b in _imports_of(package) if b.split(".")[0] in ("runtime", "apps")]
    assert bad == []


def test_the_bottom_layer_imports_nothing_of_the_other_packages():
    for bottom in ("planner.spec", "planner.mesh", "planner.flops", "planner.precision"):
        assert all(b.startswith("planner.spec") for _, b in _imports_of(bottom)), bottom


def test_the_simulator_uses_only_the_planner_bottom_layer():
    # specs, the mesh layout and the model presets: never the search that calls it
    allowed = {"planner", "planner.spec", "planner.mesh", "planner.flops", "planner.presets",
               "planner.precision", "planner.userfile"}
    bad = [(a, b) for a, b in _imports_of("simulator") if b.split(".")[0] == "planner"
           and b not in allowed]
    assert bad == []


def test_no_import_cycles():
    assert list(nx.simple_cycles(GRAPH)) == []


def test_the_graph_sees_the_imports():
    # the check above is only as good as the graph: a few edges known to exist
    assert GRAPH.has_edge("simulator.step.costs", "planner.mesh")
    assert GRAPH.has_edge("planner.search", "simulator.step.simulate")
    assert GRAPH.has_edge("runtime.train", "runtime.parallelize")
