"""The package's import graph has no circle, and no module imports the package's own
`__init__` (the public API over every layer, so importing it from inside is a circle
through everything).

The graph is read from the source (ast): every `import`/`from` statement at module level
or inside a function is an edge, to the module it names (a `from X import y` names X, and
X.y where y is a submodule). An import under `if TYPE_CHECKING:` never runs, so it is no
circle at import time; but two modules that name each other's types still know each
other (the vLLM step cuts reached back into the worker that way), so a second check
counts those imports too. The integrations are in the graph like any other module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import bsr_io

PKG = Path(bsr_io.__file__).parent


def _name(pkg: Path, path: Path) -> str:
    parts = [pkg.name, *path.relative_to(pkg).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(tree: ast.AST, typed: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in `tree` but those under `if TYPE_CHECKING:` (`typed`:
    those too)."""
    out: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif not typed and isinstance(node, ast.If) and _type_checking(node.test):
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))
    return out


def graph(pkg: Path, typed: bool = False) -> dict[str, set[str]]:
    """Each module of `pkg` and the modules of `pkg` it imports (`typed`: for type
    checkers too)."""
    paths = {_name(pkg, p): p for p in sorted(pkg.rglob("*.py"))}
    modules = set(paths) | {f"{pkg.name}._core"}  # the engine (an extension module)
    edges: dict[str, set[str]] = {}
    for me, path in paths.items():
        package = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
        mine: set[str] = set()
        for node in _statements(ast.parse(path.read_text(), str(path)), typed):
            if isinstance(node, ast.Import):
                mine.update(a.name for a in node.names)
                continue
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            mine.add(mod)
            mine.update(f"{mod}.{a.name}" for a in node.names)
        edges[me] = {m for m in mine if m in modules and m != me}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected group of more than one module (Tarjan), each
    as the path that closes it, smallest name first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [_circle(edges, g) for g in sorted(groups, key=min)]


def _circle(edges: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest path from the group's first module back to itself (breadth first)."""
    start = min(group)
    came: dict[str, str] = {}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(edges[v] & group):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(came[path[-1]])
                return [*reversed(path), start]
            if w not in came:
                came[w] = v
                todo.append(w)
    raise AssertionError(f"no circle in {sorted(group)}")


def importers_of_init(edges: dict[str, set[str]], top: str) -> list[str]:
    return sorted(me for me, theirs in edges.items() if top in theirs and me != top)


def test_the_import_graph_has_no_circle():
    assert [" -> ".join(c) for c in cycles(graph(PKG))] == []


def test_no_two_modules_know_each_other_even_for_type_checkers():
    """A circle only type checkers see (the vLLM step cuts once took the worker this
    way, and the worker them) is a circle of knowledge all the same."""
    assert [" -> ".join(c) for c in cycles(graph(PKG, typed=True))] == []


def test_no_module_imports_the_package_init():
    assert importers_of_init(graph(PKG), "bsr_io") == []


def test_the_checks_find_circles_and_imports_of_the_init(tmp_path):
    """Control: a package with a circle through a relative and a lazy import, a circle
    seen only by type checkers (not one), and modules importing the `__init__`."""
    pkg = tmp_path / "bsr_io"
    (pkg / "model").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from bsr_io.errors import E\n")
    (pkg / "errors.py").write_text("from bsr_io.model.keys import K\n")
    (pkg / "model" / "__init__.py").write_text("")
    (pkg / "model" / "keys.py").write_text("from . import layout\n")
    (pkg / "model" / "layout.py").write_text("def f():\n    import bsr_io.errors\n")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from bsr_io import b\n"
    )
    (pkg / "b.py").write_text("import bsr_io.a\nfrom bsr_io import _core\n")
    (pkg / "c.py").write_text("import bsr_io\n")
    edges = graph(pkg)
    assert cycles(edges) == [
        ["bsr_io.errors", "bsr_io.model.keys", "bsr_io.model.layout", "bsr_io.errors"]
    ]
    assert cycles(graph(pkg, typed=True)) == [
        ["bsr_io.a", "bsr_io.b", "bsr_io.a"],
        ["bsr_io.errors", "bsr_io.model.keys", "bsr_io.model.layout", "bsr_io.errors"],
    ]
    assert importers_of_init(edges, "bsr_io") == ["bsr_io.b", "bsr_io.c"]


def test_errors_import_only_the_engine_even_for_type_checkers():
    """The ground floor: `errors` names chunk keys as data (`NamedChunk`), so it imports
    nothing of the package but the engine's root class, not even under TYPE_CHECKING."""
    tree = ast.parse((PKG / "errors.py").read_text())
    names = {
        n.module if isinstance(n, ast.ImportFrom) else a.name
        for n in ast.walk(tree)
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for a in n.names
    }
    assert {n for n in names if n and n.startswith("bsr_io")} == {"bsr_io._core"}
