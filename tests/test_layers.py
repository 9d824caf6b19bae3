"""Imports go one way, in no circle: catalog <- sampling <- engine <- service <- cluster <- torch
(and the benchmarks) <- cli.

The import graph comes from the source with ``ast``: every ``import`` and ``from ... import``,
function-local imports and ``if TYPE_CHECKING:`` imports included. A module's layer comes from
``LAYERS`` alone (the most specific entry wins), so moving modules means editing that table.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tabloader", "benchmarks")

# Layers from the bottom up: a module may import only modules of its own layer or below.
CATALOG, SAMPLING, ENGINE, SERVICE, CLUSTER, TOP, CLI = range(7)
LAYER_NAMES = (
    "catalog",
    "sampling",
    "engine",
    "service",
    "cluster",
    "top (torch.py, API)",
    "cli (and the benchmarks)",
)
# "pkg.*" -> the layer of pkg and every module below it; "name" -> the layer of that module
# alone; the longest match wins.
LAYERS: dict[str, int] = {
    "tabloader": TOP,  # the package's __init__: the public API
    "tabloader.catalog.*": CATALOG,
    "tabloader.sampling.*": SAMPLING,
    "tabloader._format": ENGINE,
    "tabloader._lazy": CATALOG,  # the faces' imports on first use
    "tabloader.datagen": ENGINE,
    "tabloader.engine.*": ENGINE,
    "tabloader.service.*": SERVICE,
    "tabloader.cluster.*": CLUSTER,
    "tabloader.torch": TOP,
    "tabloader.integrations.*": TOP,  # on top of torch.py: accelerate, transformers
    "tabloader.analyze.*": TOP,  # starts a service of its own and reads it as a client
    "tabloader._demo": TOP,
    "tabloader.cli": CLI,
    "tabloader.__main__": CLI,
    "benchmarks.*": CLI,  # outside the package: they may use every public name
}
# Third-party packages a layer must not import.
FORBIDDEN = {
    CATALOG: ("torch", "ray"),
    SAMPLING: ("torch", "ray", "duckdb"),
    ENGINE: ("ray",),
    SERVICE: ("ray",),
}


def module_files() -> dict[str, Path]:
    """Every module of the packages by dotted name (a package by its own name); a C
    extension's source (``_resample.c``) is its module, which imports nothing."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")) + sorted((ROOT / package).rglob("*.c")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def layer_of(module: str) -> int:
    """The layer of ``module`` from ``LAYERS`` (its longest matching entry)."""
    matches = [
        key
        for key in LAYERS
        if module == key.removesuffix(".*")
        or (key.endswith(".*") and module.startswith(key.removesuffix("*")))
    ]
    if not matches:
        raise AssertionError(f"{module} has no layer: add it to LAYERS in {__file__}")
    return LAYERS[max(matches, key=len)]


def imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names one import statement loads: ``from a import b`` loads a.b if that is a
    module, else a (the name b is then an attribute of a)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = module if is_package else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    source = ".".join(p for p in (base if node.level else "", node.module or "") if p)
    return [f"{source}.{alias.name}" if alias.name != "*" else source for alias in node.names]


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Edges between the packages' modules, and the third-party top-level names each imports."""
    modules = module_files()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    external: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        if path.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for name in imported(node, module, is_package):
                top = name.partition(".")[0]
                if top not in PACKAGES:
                    external[module].add(top)
                    continue
                while name not in modules:  # a name inside a module: the module
                    name = name.rpartition(".")[0]
                if name != module:
                    edges[module].add(name)
    return edges, external


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def against_direction(edges: dict[str, set[str]], external: dict[str, set[str]]) -> list[str]:
    """Every import of a higher layer, or of a third-party package the layer must not use."""
    wrong = []
    for module in sorted(edges):
        layer = layer_of(module)
        for target in sorted(edges[module]):
            if layer_of(target) > layer:
                wrong.append(
                    f"{module} ({LAYER_NAMES[layer]}) -> {target} ({LAYER_NAMES[layer_of(target)]})"
                )
        for name in sorted(external[module]):
            if name in FORBIDDEN.get(layer, ()):
                wrong.append(f"{module} ({LAYER_NAMES[layer]}) -> {name} (forbidden there)")
    return wrong


def cycle_edges(edges: dict[str, set[str]], component: list[str]) -> str:
    """The edges inside one circle, one per line."""
    inside = set(component)
    return "\n".join(f"  {a} -> {b}" for a in component for b in sorted(edges[a]) if b in inside)


def test_the_import_graph_has_no_circle():
    edges, _ = import_graph()
    found = circles(edges)
    assert not found, "import circles (edges inside each):\n" + "\n".join(
        f"{' / '.join(c)}:\n{cycle_edges(edges, c)}" for c in found
    )


def test_imports_follow_the_layers():
    edges, external = import_graph()
    wrong = against_direction(edges, external)
    assert not wrong, (
        "imports against catalog <- sampling <- engine <- service <- cluster <- torch <- cli:\n"
        + "\n".join(wrong)
    )


def test_every_module_has_a_layer():
    for module in module_files():
        layer_of(module)


def test_the_checks_find_a_circle_and_an_upward_import():
    """The checks can fail: a made-up graph with both faults is reported."""
    edges = {
        "tabloader.engine._prepare.fetch": {"tabloader.engine._deliver.collate"},
        "tabloader.engine._deliver.collate": {"tabloader.engine._prepare.fetch"},
        "tabloader.service._server": {"tabloader.cluster._node", "tabloader.cli"},
        "tabloader.cluster._node": set(),
        "tabloader.cli": set(),
        "tabloader.catalog._catalog": set(),
    }
    external = {m: set() for m in edges} | {"tabloader.catalog._catalog": {"torch", "numpy"}}
    assert circles(edges) == [
        ["tabloader.engine._deliver.collate", "tabloader.engine._prepare.fetch"]
    ]
    assert against_direction(edges, external) == [
        "tabloader.catalog._catalog (catalog) -> torch (forbidden there)",
        "tabloader.service._server (service) -> tabloader.cli (cli (and the benchmarks))",
        "tabloader.service._server (service) -> tabloader.cluster._node (cluster)",
    ]
    with pytest.raises(AssertionError, match="has no layer: add it to LAYERS"):
        layer_of("tabloader.new_module")  # only the package itself is "tabloader"
    assert layer_of("tabloader.cluster._names") == CLUSTER
    assert layer_of("tabloader.cluster") == CLUSTER


def test_imports_are_resolved_like_python():
    tree = ast.parse(
        "from . import shm\nfrom ..arena import Arena\nimport tabloader.catalog._errors"
    )
    nodes = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    names = [imported(n, "tabloader.service", is_package=True) for n in nodes]
    assert names == [
        ["tabloader.service.shm"],
        ["tabloader.arena.Arena"],
        ["tabloader.catalog._errors"],
    ]
