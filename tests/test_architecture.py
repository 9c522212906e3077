"""The tree stays easy to change: no module over :data:`MAX_LINES` lines, and no import cycle
among streamcache's modules.

Imports are read with ``ast``, not by importing: every ``import`` and ``from ... import`` counts,
at the top of a module, inside a function or under ``TYPE_CHECKING`` alike (a lazy import that
goes upward is still a circle a reader has to hold in mind). ``from package import name`` is an
edge to the submodule when ``name`` is one, else to the package; ``from . import _core`` is the
native extension.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "streamcache"
MAX_LINES = 450
NATIVE = "_core"  # the compiled extension: no source, never a cycle


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imported(name: str, path: Path, modules: dict[str, Path]) -> Iterator[str]:
    """The streamcache modules that ``name`` (at ``path``) imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                if alias.name == NATIVE:
                    continue
                submodule = f"{target}.{alias.name}"
                if submodule in modules:
                    yield submodule
                elif target in modules:
                    yield target


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {target for target in _imported(name, path, modules) if target != name}
            for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
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
                        found.append(sorted(component))
    return found


def _describe(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    return "\n".join(f"  {name} -> {', '.join(sorted(graph[name] & members))}"
                     for name in component)


def test_no_module_is_over_the_line_limit() -> None:
    lengths = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    over = sorted((lines, name) for name, lines in lengths.items() if lines > MAX_LINES)
    assert not over, (
        f"modules over {MAX_LINES} lines (split each along its responsibilities):\n"
        + "\n".join(f"  {name}: {lines} lines" for lines, name in over))


def test_no_import_cycle() -> None:
    graph = _graph()
    cycles = _cycles(graph)
    assert not cycles, "import cycles among streamcache's modules:\n" + "\n\n".join(
        _describe(component, graph) for component in cycles)


def test_the_cycle_finder_sees_a_cycle_and_a_lazy_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    modules = _modules()
    edges = _graph()
    assert "streamcache.format.shard_table" in edges["streamcache.format.index"]
    assert "streamcache.cli.plots" in edges["streamcache.cli.goodput"]  # imported in run()
    assert all(NATIVE not in target for targets in edges.values() for target in targets)
    assert "streamcache" in modules
