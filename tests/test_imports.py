"""The import graph of engine/ and sim/, read from the source (nothing is imported):
no cycle between modules, and no private name (`_name`) imported from another module.

Every import statement counts, at the top of a module or inside a function: a
cycle through a function-level import is a cycle all the same, only deferred.
`from package import name` is an edge to package.name when that is a module,
else to the package. A package's __init__ is a module like any other; the
implicit import of a parent package is not an edge.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "sim")  # the graph: cycles and private names
SCRIPTS = ("benchmarks",)  # scripts beside them: private names only


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(dirs: tuple[str, ...]) -> dict[str, Path]:
    return {_module_name(p): p for d in dirs for p in sorted((ROOT / d).rglob("*.py"))}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _imports(module: str, path: Path, known: set[str]) -> list[tuple[str, str | None, int]]:
    """(imported module, name imported from it or None, line) for every import of a known module."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if a.name in known]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in known:
                    out.append((sub, None, node.lineno))
                elif base in known:
                    out.append((base, a.name, node.lineno))
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules(PACKAGES)
    known = set(modules)
    return {m: {target for target, _, _ in _imports(m, p, known) if target != m} for m, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_read() -> None:
    graph = _graph()
    assert "engine.cli" in graph and "sim" in graph
    assert "engine.job" in graph["engine.cli"]  # a top-level import
    assert "engine.validation" in graph["engine.modes.validate"]  # a function-level `from engine import x`


def test_no_import_cycle() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_private_name_is_imported_from_another_module() -> None:
    modules = _modules(PACKAGES + SCRIPTS)
    # Scripts import each other by bare name (benchmarks/ on sys.path).
    known = set(modules) | {m.rpartition(".")[2] for m in _modules(SCRIPTS)}
    found = [f"{path.relative_to(ROOT)}:{line}: {name} from {target}"
             for module, path in modules.items()
             for target, name, line in _imports(module, path, known)
             if name is not None and _private(name)]
    assert not found, "private names imported across modules:\n" + "\n".join(found)
