"""No import cycles among cpattn's modules (issue 19).

Every module under cpattn/ is parsed with ast; an edge A -> B is any ``import``/``from ... import`` of a
cpattn module in A, at module level or inside a function. Function-level imports count: they defer a
cycle to the first call but the two modules still depend on each other (backend.py imported
backends/torch_ref.py inside a method, torch_ref.py imported backend.py at the top). Imports under
``if TYPE_CHECKING:`` do not count (they never run). ``from pkg import name`` is an edge to the submodule
pkg.name when one exists, else to pkg's ``__init__``; the implicit import of a parent package that Python
runs before a submodule is not an edge (a package ``__init__`` that re-exports its submodules would
otherwise be in a cycle with each of them).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "cpattn"


def module_files() -> dict[str, Path]:
    files = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Import nodes anywhere in the tree except under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from (n for child in node.orelse for n in _imports_of(child))
            continue
        yield from _imports_of(node)


def _imports_of(node: ast.AST):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    else:
        yield from _imports(node)


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:   # relative: from . / .. import
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[:len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            for target in targets:
                if target.split(".")[0] != PACKAGE:
                    continue
                resolved = _resolve(target, modules)
                if resolved and resolved != name:
                    graph[name].add(resolved)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative DFS with colours)."""
    state: dict[str, int] = {}   # 1 on the stack, 2 done
    for start in sorted(graph):
        if state.get(start):
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif not state.get(child):
                state[child] = 1
                stack.append((child, iter(sorted(graph[child]))))
                path.append(child)
    return None


def test_graph_sees_function_level_and_from_package_imports():
    graph = import_graph()
    assert "cpattn.attention.ops.reference" in graph["cpattn.attention.backends.torch_ref"]   # from pkg import mod
    assert "cpattn.cluster.service" in graph["cpattn"]                                        # inside start()
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_attention_ops_imports_nothing_above_it():
    """The floor imports only itself, errors, kvstore, and the Triton merge kernel (which imports only the floor)."""
    graph = import_graph()
    floor = {m for m in graph if m.startswith("cpattn.attention.ops")} | {"cpattn.attention.merge_triton"}
    allowed = floor | {"cpattn.errors"}
    for module in sorted(floor):
        above = {t for t in graph[module] if t not in allowed and not t.startswith("cpattn.kvstore")}
        assert not above, f"{module} imports {sorted(above)} from above the ops floor"


def test_cluster_never_imports_the_public_face():
    """cluster/ sits below the public face: a step's life is owned there (cluster/step_run.py), so nothing in it
    calls back up into cpattn.step or cpattn.client (gateway.flush once imported cpattn.step inside a method)."""
    graph = import_graph()
    public = {"cpattn", "cpattn.step", "cpattn.client", "cpattn.step_inputs"}
    for module in sorted(m for m in graph if m.startswith("cpattn.cluster")):
        assert not graph[module] & public, f"{module} imports {sorted(graph[module] & public)} from above cluster/"
