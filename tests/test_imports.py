"""The import graph of src/urpe, read with `ast` (nothing is imported): no cycles, no module
importing another module's private names, and imports only going down the layers of the house
(kernels -> encodings -> nn -> models -> data/tasks -> training -> experiments/CLI), the core
importing nothing but torch and the standard library.

Every `import` statement counts wherever it sits: at the top of a module, inside a function, or
under `if TYPE_CHECKING:`. An import inside a function still makes the two modules depend on each
other, so it hides a cycle rather than removing it.

Edges go to the module an import names (`from .a import b` -> `pkg.a`, or `pkg.a.b` where b is a
submodule); the parent packages' `__init__` that Python runs on the way are not edges, so a
package that re-exports its modules does not make every module of it a cycle with the others.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "urpe"

# Layers, bottom to top (../shared/STYLE.md). A module's layer is its longest listed prefix;
# a module may import its own layer and those below.
LAYERS = {
    "urpe.files": 0,
    "urpe.progress": 0,  # standard-library helpers every layer may use
    "urpe.kernels": 1,
    "urpe.encodings": 2,
    "urpe.nn": 3,
    "urpe.models": 4,
    "urpe.graph": 4,
    "urpe.hf": 4,
    "urpe": 4,  # urpe/__init__.py: the public names of the core (the rest resolved lazily)
    "urpe.data": 5,
    "urpe.tasks": 5,
    "urpe.training": 6,
    "urpe.experiments": 7,
    "urpe.bench": 7,
    "urpe.cli": 7,
    "urpe.cli_types": 7,
    "urpe.__main__": 7,
}
CORE = ("urpe.kernels", "urpe.encodings", "urpe.nn", "urpe.models")
# What the core may import besides urpe itself: torch, the standard library, and Triton, which
# ships with torch's CUDA wheels and is imported only by the GPU kernels.
CORE_THIRD_PARTY = {"torch", "triton"}


@dataclass(frozen=True)
class Import:
    importer: str  # the module whose file holds the statement
    target: str  # the module it imports (an edge of the graph)
    name: str | None  # the name taken from `target` (`from target import name`), if any
    line: int

    def __str__(self) -> str:
        what = f"{self.target}.{self.name}" if self.name else self.target
        return f"{self.importer}:{self.line} imports {what}"


@cache
def modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package's __init__)."""
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _known(name: str) -> str:
    """The longest prefix of `name` that is a module of the package."""
    while name not in modules() and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _absolute(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name a relative import (`level` dots) means inside `module`."""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


@cache
def imports() -> tuple[Import, ...]:
    """Every import of a urpe module in the package, at any depth of any file."""
    found = []
    for module, (path, is_package) in modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == PACKAGE:
                        found.append(Import(module, _known(alias.name), None, node.lineno))
            elif isinstance(node, ast.ImportFrom):
                target = (
                    _absolute(module, is_package, node.level, node.module)
                    if node.level
                    else node.module or ""
                )
                if target.split(".")[0] != PACKAGE:
                    continue
                for alias in node.names:
                    submodule = f"{target}.{alias.name}"
                    if submodule in modules():  # `from pkg import module`
                        found.append(Import(module, submodule, None, node.lineno))
                    else:
                        found.append(Import(module, _known(target), alias.name, node.lineno))
    return tuple(found)


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in modules()}
    for edge in imports():
        if edge.target != edge.importer:
            edges[edge.importer].add(edge.target)
    return edges


def strongly_connected(edges: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative: the components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(edges):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(edges[root])))]
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
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return components


def describe_cycle(component: set[str]) -> str:
    lines = [str(e) for e in imports() if e.importer in component and e.target in component]
    return "cycle between " + ", ".join(sorted(component)) + ":\n    " + "\n    ".join(lines)


def cycles() -> list[set[str]]:
    return strongly_connected(graph())


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports() -> list[str]:
    """`from other import _name`, `import other._module`, and `other._name` on a module bound by
    an import: each a use of a name that `other` keeps to itself. A package's own modules may
    import its private modules (`from ._requirements import X` in urpe/hf)."""
    found = []
    for edge in imports():
        if edge.name is not None and _private(edge.name) and edge.target != edge.importer:
            found.append((edge.importer, edge.target, str(edge)))
        hidden = [p for p in edge.target.split(".") if _private(p)]
        if hidden:
            owner = edge.target.rsplit(".", 1)[0]
            if not (edge.importer == owner or edge.importer.startswith(owner + ".")):
                found.append((edge.importer, edge.target, str(edge)))
    for module, (path, is_package) in modules().items():
        tree = ast.parse(path.read_text())
        bound: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = (
                    _absolute(module, is_package, node.level, node.module)
                    if node.level
                    else node.module or ""
                )
                for alias in node.names:
                    if f"{target}.{alias.name}" in modules():
                        bound[alias.asname or alias.name] = f"{target}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == PACKAGE and alias.asname:
                        bound[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
                and _private(node.attr)
                and bound[node.value.id] != module
            ):
                where = f"{module}:{node.lineno} uses {bound[node.value.id]}.{node.attr}"
                found.append((module, bound[node.value.id], where))
    return found


def layer(module: str) -> int:
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in LAYERS:
            return LAYERS[prefix]
    raise AssertionError(f"{module} has no layer: add its package to LAYERS")


def _third_party(path: Path) -> Iterator[tuple[str, int]]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top not in sys.stdlib_module_names and top not in {"__future__", PACKAGE}:
                yield name, node.lineno


# ---------------------------------------------------------------------------------------------


def test_the_reader_sees_every_kind_of_import():
    """The graph holds function-level and relative imports (the cycles they used to hide)."""
    seen = {(e.importer, e.target) for e in imports()}
    assert ("urpe.cli", "urpe") in seen  # `from . import __version__`
    assert len(modules()) > 150 and len(seen) > 300
    function_level = []
    for path, _ in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                function_level += [n for n in ast.walk(node) if isinstance(n, ast.ImportFrom)]
    assert len(function_level) > 50


def test_tarjan_finds_a_cycle_through_three_modules_and_not_a_chain():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert strongly_connected(edges) == [{"a", "b", "c"}]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    found = cycles()
    assert not found, (
        "import cycles (break them by moving the shared part into a module both "
        "import):\n" + "\n".join(describe_cycle(c) for c in found)
    )


def test_no_module_imports_another_modules_private_names():
    found = [w for _, _, w in private_imports()]
    assert not found, (
        "private names used outside their module (make them public, or move "
        "them where both can import them):\n" + "\n".join(found)
    )


def test_imports_only_go_down_the_layers():
    upward = [
        f"{e} (layer {layer(e.importer)} -> {layer(e.target)})"
        for e in imports()
        if layer(e.target) > layer(e.importer)
    ]
    assert not upward, "imports that go up the layers:\n" + "\n".join(upward)


def test_the_core_imports_only_torch_and_the_standard_library():
    found = [
        f"{module}:{line} imports {name}"
        for module, (path, _) in modules().items()
        if module.startswith(CORE)
        for name, line in _third_party(path)
        if name.split(".")[0] not in CORE_THIRD_PARTY
    ]
    assert not found, "the core depends on torch alone:\n" + "\n".join(found)
