"""No import cycles in ``ddiloco``: every module's imports, including those inside functions (a lazy import is
still a dependency), form a graph without cycles. Imports under ``if TYPE_CHECKING:`` are left out: they never run.

A cycle means two modules that cannot be understood (or imported, or tested) one without the other; most of all,
nothing below the CLI may import the CLI (STYLE.md, one entry per process)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ddiloco"


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        if "migrations" in path.parts:  # Alembic loads these by path, never by import
            continue
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Ids of the import nodes under ``if TYPE_CHECKING:``."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt) if isinstance(n, ast.Import | ast.ImportFrom)}
    return skip


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports (``from a import b``: module a.b if there is one, else a)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_only(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join([*pkg, base] if base else pkg)
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    known = modules()
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
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


def test_the_walker_sees_lazy_imports_and_skips_type_checking_ones(tmp_path: Path) -> None:
    known = {"p.a": tmp_path / "a.py", "p.b": tmp_path / "b.py", "p.c": tmp_path / "c.py"}
    known["p.a"].write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p import c\n"
                            "def f():\n    from p.b import g\n")
    assert imports_of("p.a", known["p.a"], known) == {"p.b"}


@pytest.mark.timeout(60)
def test_ddiloco_has_no_import_cycles() -> None:
    assert import_cycles() == []
