"""Architecture guards: the layers of autopar import downward only, the torch-free layers stay
torch-free, no import cycle, modules stay small and their names unique within their package.

The import graph is read from the source (``ast``), not from a running interpreter: an import
inside a function is a dependency as much as one at the top (it runs on first call), and so is
one under ``if TYPE_CHECKING:``: it never runs, but a reader still needs the imported module to
understand the importer, so a cycle through it is a cycle of the design (``_graph``). Only the
layer rule, which is about what a layer needs to run, leaves those out. Imports by computed name
(``importlib.import_module(f"...")``: the rule families, ``autopar.__getattr__``) are not seen.
"""

from __future__ import annotations

import ast
import collections
import functools
import pathlib
import subprocess
import sys
import tomllib
from dataclasses import dataclass

import networkx as nx
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "autopar"
MAX_LINES = 600
TORCH_FREE = ("autopar.layout", "autopar.solver", "autopar.offload")
# Compiled modules (built from csrc/): graph nodes without imports of their own.
EXTENSIONS = frozenset(e["name"] for e in tomllib.loads((ROOT / "pyproject.toml").read_text())
                       ["tool"]["setuptools"].get("ext-modules", ()))

# Layer (a subpackage or top-level module of autopar) -> the layers its modules may import.
# api, cli, zoo and the package root sit on top and may import anything.
MAY_IMPORT = {
    "autopar.layout": {"autopar.layout"},
    "autopar.stages": {"autopar.stages"},
    # the offload record (Gemini's static fractions), plain data read by planner, runtime and booster
    "autopar.offload": {"autopar.offload"},
    "autopar.plans": {"autopar.plans", "autopar.layout"},
    # layout is the device-free vocabulary (plans already build on it); the tracer reads its
    # block names (``layout.blocks``) to recognise repeated blocks
    "autopar.tracer": {"autopar.tracer", "autopar.plans", "autopar.layout"},
    "autopar.strategies": {"autopar.strategies", "autopar.tracer", "autopar.layout"},
    # the Rotor DP's C twin (autopar._rotor) is part of the solver
    "autopar.solver": {"autopar.solver", "autopar.layout", *EXTENSIONS},
    # the orchestration (planner.orchestrate) reports its stages through the leaf Progress
    "autopar.planner": {"autopar.planner", "autopar.tracer", "autopar.strategies", "autopar.layout",
                        "autopar.solver", "autopar.plans", "autopar.offload", "autopar.stages"},
    "autopar.runtime": {"autopar.runtime", "autopar.tracer", "autopar.strategies", "autopar.layout",
                        "autopar.plans", "autopar.offload"},
    "autopar.report": {"autopar.report", "autopar.planner", "autopar.layout", "autopar.plans"},
    # runtime level: distributed optimizers on DTensors (torch, torch.distributed, the layout)
    "autopar.optim": {"autopar.optim", "autopar.layout"},
    # on top, like api: the Booster boosts through api and the runtime (optim imported lazily)
    "autopar.booster": {"autopar.booster", "autopar.api", "autopar.runtime", "autopar.optim", "autopar.planner",
                        "autopar.tracer", "autopar.layout", "autopar.plans", "autopar.offload"},
}


@dataclass(frozen=True, slots=True)
class Import:
    importer: str  # dotted module name
    imported: str  # the most specific autopar module the statement names
    line: int
    type_checking: bool = False  # under ``if TYPE_CHECKING:``: never runs, still a dependency of the design

    def __str__(self) -> str:
        return f"{self.importer}:{self.line} imports {self.imported}"


def _layer(module: str) -> str:
    return ".".join(module.split(".")[:2])


@functools.cache
def _modules() -> dict[str, pathlib.Path]:
    """Dotted name -> file of every Python module of the package (a package is its __init__)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_statements(tree: ast.AST) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement at any depth, with whether it sits in the body of ``if TYPE_CHECKING:``."""
    found, stack = [], [(tree, False)]
    while stack:
        node, checking = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append((node, checking))
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                stack.extend((c, True) for c in child.body)
                stack.extend((c, checking) for c in child.orelse)
            else:
                stack.append((child, checking))
    return sorted(found, key=lambda f: f[0].lineno)


def _imports_of(name: str, source: str, *, is_package: bool) -> list[Import]:
    """The autopar modules that module ``name`` imports (``from pkg import mod`` names ``pkg.mod``),
    those under ``if TYPE_CHECKING:`` marked."""
    known = set(_modules()) | EXTENSIONS

    def most_specific(dotted: str) -> str:
        while dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted

    package = name if is_package else name.rpartition(".")[0]
    out = []
    for node, checking in _import_statements(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in targets:
            if target.split(".")[0] == "autopar" and most_specific(target) != name:
                out.append(Import(name, most_specific(target), node.lineno, type_checking=checking))
    return out


@functools.cache
def _all_imports() -> tuple[Import, ...]:
    return tuple(imp for name, path in _modules().items()
                 for imp in _imports_of(name, path.read_text(), is_package=path.name == "__init__.py"))


def _graph() -> nx.DiGraph:
    """Every import, ``TYPE_CHECKING`` ones included: a cycle that only type hints close is still
    two modules that cannot be read, moved or tested one without the other."""
    graph = nx.DiGraph()
    graph.add_nodes_from(_modules())
    for imp in _all_imports():
        if not graph.has_edge(imp.importer, imp.imported):
            graph.add_edge(imp.importer, imp.imported, line=imp.line)
    return graph


# ------------------------------------------------------------------------------- the reader
def test_import_reader_counts_lazy_relative_and_type_checking_imports():
    source = "\n".join([
        "from typing import TYPE_CHECKING",
        "import torch",
        "from autopar.layout import placement",  # a submodule named in the import list
        "from autopar.strategies import Strategy",  # a name: the package itself
        "from . import rotor",
        "from .problem import Problem",
        "if TYPE_CHECKING:",
        "    from autopar.planner import builder",
        "else:",
        "    import autopar.plans",
        "def late():",
        "    from autopar.tracer.graph import MODULE_KEY",
    ])
    found = _imports_of("autopar.solver.ilp", source, is_package=False)
    imports = [i for i in found if not i.type_checking]
    assert [str(i) for i in imports] == [
        "autopar.solver.ilp:3 imports autopar.layout.placement",
        "autopar.solver.ilp:4 imports autopar.strategies",
        "autopar.solver.ilp:5 imports autopar.solver.rotor",
        "autopar.solver.ilp:6 imports autopar.solver.problem",
        "autopar.solver.ilp:10 imports autopar.plans",
        "autopar.solver.ilp:12 imports autopar.tracer.graph",
    ]
    # the body of ``if TYPE_CHECKING:`` is read too, marked (the cycle check counts it)
    assert [str(i) for i in found if i.type_checking] == ["autopar.solver.ilp:8 imports autopar.planner.builder"]
    # a package's own relative imports start from the package, not from its parent
    (own,) = _imports_of("autopar.solver", "from .rotor import rotor_schedule", is_package=True)
    assert own.imported == "autopar.solver.rotor"


# ----------------------------------------------------------------------------------- torch
def _top_level_names(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_solver_and_layout_sources_do_not_import_torch():
    files = [path for name, path in _modules().items() if _layer(name) in TORCH_FREE]
    assert len(files) > len(TORCH_FREE)
    offenders = [str(f.relative_to(ROOT)) for f in files if "torch" in _top_level_names(f)]
    assert offenders == [], f"these must stay torch-free (plain data): {offenders}"


def test_importing_solver_and_layout_loads_no_torch():
    modules = sorted(name for name in _modules() if _layer(name) in TORCH_FREE)
    assert {"autopar.solver.ilp", "autopar.solver.recompute_ilp", "autopar.solver.rotor",
            "autopar.solver.simplify", "autopar.layout"} <= set(modules)
    code = f"import sys, {', '.join(modules)}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False", modules


def test_import_autopar_does_not_import_torch():
    code = "import sys, autopar; autopar.MeshSpec; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------------------------- layers
def test_no_import_cycle_among_modules():
    graph = _graph()
    assert graph.number_of_edges() > len(_modules())  # the reader found the imports
    cycles = []
    for component in nx.strongly_connected_components(graph):
        if len(component) > 1:
            edges = nx.find_cycle(graph.subgraph(component))
            cycle = " -> ".join(f"{a}:{graph.edges[a, b]['line']}" for a, b in edges) + f" -> {edges[0][0]}"
            cycles.append(f"{cycle}  (modules in the cycles: {', '.join(sorted(component))})")
    assert cycles == [], "import cycles (module:line of the import):\n" + "\n".join(sorted(cycles))


@pytest.mark.parametrize("layer", sorted(MAY_IMPORT))
def test_layer_imports_only_the_layers_below(layer):
    assert any(_layer(name) == layer for name in _modules()), f"no module in layer {layer}"
    # What a layer needs to run: a type-only import (the report's ``Evaluation``) loads nothing.
    wrong = [str(i) for i in _all_imports() if not i.type_checking and _layer(i.importer) == layer
             and _layer(i.imported) not in MAY_IMPORT[layer]]
    assert wrong == [], f"{layer} may import only {sorted(MAY_IMPORT[layer])}:\n" + "\n".join(wrong)


# ----------------------------------------------------------------------------------- files
def test_no_module_over_600_lines():
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert sizes
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


def test_no_two_modules_of_a_package_share_a_name():
    """Names are unique within a package (``planner.pipeline.assemble`` beside ``planner.assemble``
    is fine: a module is named by its package path); within one, a ``foo.py`` beside a package
    ``foo/`` or a compiled ``foo.*.so`` would shadow one another."""
    by_package = collections.defaultdict(list)
    for path in PACKAGE.rglob("*"):
        if path.suffix == ".py" and path.name not in ("__init__.py", "__main__.py"):
            by_package[path.parent].append(path.stem)
        elif path.suffix in (".so", ".pyd"):
            by_package[path.parent].append(path.name.split(".")[0])
        elif path.is_dir() and (path / "__init__.py").exists():
            by_package[path.parent].append(path.name)
    assert sum(map(len, by_package.values())) > len(_modules()) // 2
    shared = {str(pkg.relative_to(ROOT)): sorted(n for n in set(names) if names.count(n) > 1)
              for pkg, names in by_package.items() if len(set(names)) < len(names)}
    assert shared == {}


def test_no_merge_conflict_markers_left_in_the_tree():
    """A conflict resolved inside a docstring still imports, so only a scan of the text catches
    it (one was left in ``AutoParallelPlugin``'s docstring by a merge)."""
    markers = ("<" * 7 + " ", ">" * 7 + " ", "=" * 7 + "\n")
    found = []
    for path in ROOT.rglob("*"):
        if path.suffix not in {".py", ".md", ".toml", ".json", ".c", ".txt"} or ".venv" in path.parts \
                or ".git" in path.parts or not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(keepends=True), 1):
            if line.startswith(markers):
                found.append(f"{path.relative_to(ROOT)}:{number}")
    assert not found, f"merge-conflict markers left in: {found}"
