"""The layers of design.md, imports pointing down only:

    cli/ -> flows/ -> tasks/ -> areal_pipeline/ (run_spec.py above the registries) -> areal_pipeline/config/

Read from the source with `ast`, every import counted wherever it is written (inside functions and `if
TYPE_CHECKING:` blocks too, relative ones resolved): no import cycle among the project's modules, the library
imports no Prefect and nothing above it, and the configuration imports nothing of the project but its errors.
Also checked in a fresh interpreter: importing every module of the library loads no Prefect."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("areal_pipeline", "flows", "tasks", "cli")


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the project's packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imported_names(module: str, path: Path) -> set[str]:
    """The dotted names `module` imports anywhere in its source, relative imports resolved (`from x import y`
    gives x.y where that is a module, else x)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module
            names.update(f"{stem}.{a.name}" if f"{stem}.{a.name}" in MODULES else stem for a in node.names)
    return names


def _project_module(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _graph() -> dict[str, set[str]]:
    """Module -> the project modules importing it runs: the one it names and the packages above that one, less the
    packages above the importer itself (those are imported already when it runs)."""
    graph = {}
    for module, path in MODULES.items():
        edges = set()
        for name in _imported_names(module, path):
            target = _project_module(name)
            if target is not None:
                edges.update(m for m in [*_ancestors(target), target] if m in MODULES)
        graph[module] = edges - {module} - set(_ancestors(module))
    return graph


GRAPH = _graph()


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected component of more than one module, as one cycle through it (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(_cycle_through(sorted(component), graph) + [f"({len(component)} modules)"])
    return components


def _cycle_through(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest import path from the component's first module back to itself, within the component."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    return paths[node] + [start]
                if child not in paths:
                    paths[child] = paths[node] + [child]
                    following.append(child)
        frontier = following
    return component


def _imports_of(prefix: str) -> dict[str, set[str]]:
    return {m: names for m, names in ((m, GRAPH[m]) for m in MODULES if m == prefix or m.startswith(prefix + "."))}


def _in(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_graph_sees_imports_inside_functions():
    """The counting itself: an import inside a function (the command line's of flows) and a relative one count."""
    assert "flows.train" in GRAPH["cli.commands"]
    assert {"areal_pipeline.config.rules", "areal_pipeline.config.schema"} <= GRAPH["areal_pipeline.config.loading"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a", "(3 modules)"]]


def test_no_import_cycle_among_the_projects_modules():
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_each_layer_imports_only_below_it():
    upward = [f"{m} -> {t}" for m, targets in GRAPH.items() for t in targets if
              (_in(m, "areal_pipeline") and _in(t, "flows", "tasks", "cli"))
              or (_in(m, "tasks") and _in(t, "flows", "cli")) or (_in(m, "flows") and _in(t, "cli"))]
    assert not upward, "imports that point up:\n" + "\n".join(upward)


def test_the_library_names_no_prefect():
    named = [f"{m} imports {name}" for m, path in MODULES.items() if _in(m, "areal_pipeline")
             for name in _imported_names(m, path) if name == "prefect" or name.startswith("prefect.")]
    assert not named, "\n".join(named)


def test_the_configuration_is_a_leaf():
    """areal_pipeline/config/ imports nothing of the project but its errors; the run assembly is what knows the
    workflows, losses and curricula."""
    outside = {f"{m} -> {t}" for m, targets in _imports_of("areal_pipeline.config").items() for t in targets
               if not _in(t, "areal_pipeline.config") and t != "areal_pipeline.errors"}
    assert not outside, "the configuration imports:\n" + "\n".join(sorted(outside))
    assert {"areal_pipeline.workflows", "areal_pipeline.placement", "areal_pipeline.training.loss_registry",
            "areal_pipeline.warm_start"} <= GRAPH["areal_pipeline.run_spec"]


IMPORT_ALL = """
import importlib, pkgutil, sys
import areal_pipeline
failed = []
for module in pkgutil.walk_packages(areal_pipeline.__path__, "areal_pipeline."):
    try:
        importlib.import_module(module.name)
    except ImportError as error:  # an optional extra that is not installed (sglang)
        failed.append(f"{module.name}: {error}")
prefect = sorted(name for name in sys.modules if name == "prefect" or name.startswith("prefect."))
print("PREFECT", prefect[:5])
print("FAILED", failed)
"""


def test_the_library_imports_no_prefect():
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith(("PREFECT", "FAILED")))
    assert lines["PREFECT"] == "[]", f"imported by the library: {lines['PREFECT']}"
    assert lines["FAILED"] == "[]", lines["FAILED"]
