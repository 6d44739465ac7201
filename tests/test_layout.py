"""The package's shape: no module imports another in a circle (at the top of a file or inside a
function), and every old import path of a moved module still imports, as the same module."""

import ast
import importlib
import pathlib
import sys
import warnings

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the twell modules it imports anywhere in its body (``from . import x`` of a
    submodule counts as importing ``x``)."""
    files = {module_name(p): p for p in (SRC / "twell").rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                base = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            edges.update(t for t in targets if t in files and t != name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_planted_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    graph = import_graph()
    assert "twell.inference.dispatch" in graph and "twell.recipe.trainer" in graph
    assert cycles(graph) == []


@pytest.mark.parametrize("old", ["twell.ops", "twell.dispatch", "twell.eager_graphs", "twell.path_timing",
                                 "twell.train_ops", "twell.train_path", "twell.train", "twell.train.trainer",
                                 "twell.train.data", "twell.data_cli", "twell.library"])
def test_old_import_paths_give_the_moved_module(old, monkeypatch):
    from twell._moved import new_path

    monkeypatch.delitem(sys.modules, old, raising=False)  # imported by an earlier test: import it anew
    new = new_path(old)
    assert new is not None and new != old
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            module = importlib.import_module(old)
    assert module is importlib.import_module(new)
