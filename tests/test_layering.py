"""The project's layering, read from the sources: ``megatron/skrull -> skrull_ext -> _C``.

Static (ast), so lazy imports inside functions and ``TYPE_CHECKING`` blocks count: a
circle that only a type checker walks still couples the two modules' load order.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    """Module name -> file, for every module of skrull_ext and megatron/skrull."""
    files = list((ROOT / "skrull_ext").rglob("*.py")) + list((ROOT / "megatron" / "skrull").rglob("*.py"))
    out = {}
    for f in files:
        name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = f
    return out


def _imported(path: Path) -> set[str]:
    """Every module name an ``import`` / ``from ... import`` in ``path`` names, anywhere."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: {n for n in _imported(f) if n in mods and n != m} for m, f in mods.items()}


def _find_cycle(edges: dict[str, set[str]]) -> list[str]:
    """One import circle as ``[a, b, ..., a]``, or ``[]`` (iterative DFS)."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    for root in sorted(edges):
        if root in state:
            continue
        stack = [(root, iter(sorted(edges[root])))]
        path = [root]
        state[root] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif child not in state:
                state[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(edges[child]))))
    return []


def test_no_import_circles():
    assert _find_cycle(_graph()) == []


def test_cycle_finder_finds_a_lazy_circle():
    # The checker itself must be able to fail: a two-module circle and a longer one.
    assert _find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"b"}, "d": set()}) == ["b", "c", "b"]
    assert _find_cycle({"a": {"b"}, "b": set()}) == []


def test_skrull_ext_never_imports_megatron():
    offenders = {m: sorted(n for n in _imported(f) if n.split(".")[0] == "megatron")
                 for m, f in _modules().items() if m.startswith("skrull_ext")}
    assert {m: n for m, n in offenders.items() if n} == {}


def test_megatron_is_a_namespace_package():
    # An __init__.py here would hide megatron.core of the megatron-core wheel.
    assert not (ROOT / "megatron" / "__init__.py").exists()
    assert (ROOT / "megatron" / "skrull" / "__init__.py").exists()
