"""The code's shape, checked: the import graph of `src/lopd` has no circle (lazy and type-only imports
included), and no module but `runs.py` names a file inside a run directory."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "lopd"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the lopd modules it imports anywhere in its file (top level, inside functions, under
    TYPE_CHECKING). `from lopd.x import y` counts as importing lopd.x.y when that is a module, else lopd.x."""
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("lopd")}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                if not base.startswith("lopd"):
                    continue
                for alias in node.names:
                    found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each listed sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_circle():
    graph = import_graph()
    assert len(graph) > 20 and "lopd.loop" in graph["lopd.cli"] | {m for deps in graph.values() for m in deps}
    assert circles(graph) == []


def test_the_circle_finder_finds_circles():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def _run_dir_joins(tree: ast.AST) -> list[tuple[int, str]]:
    """`<something>.path / "name"` and `<run>.path / f"..."`: a path inside a run directory built by hand."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.left, ast.Attribute) \
                and node.left.attr == "path" and isinstance(node.right, (ast.Constant, ast.JoinedStr)):
            owner = ast.unparse(node.left.value)
            if owner in ("run", "self.run", "session.run", "cell", "c") or owner.endswith("run"):
                found.append((node.lineno, ast.unparse(node)))
    return found


@pytest.mark.parametrize("path", sorted(p for p in SRC.rglob("*.py") if p.name != "runs.py"), ids=lambda p: p.name)
def test_only_runs_py_names_the_files_of_a_run_directory(path):
    assert _run_dir_joins(ast.parse(path.read_text())) == []
