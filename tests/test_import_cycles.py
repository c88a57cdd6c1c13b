"""No import cycles in ``ddiloco``: every module's imports, including those inside functions (a lazy import is
still a dependency), form a graph without cycles. Imports under ``if TYPE_CHECKING:`` are left out: they never run.

A cycle means two modules that cannot be understood (or imported, or tested) one without the other. The same graph
holds the layering (STYLE.md, one entry per process): nothing below the CLI imports the CLI, the runtime never imports
the test scaffolding (``ddiloco.testing``), and a process body (learner, synchronizer, evaluator) is reached only
through ``ddiloco.entry``, so every path that starts one runs the same checks."""

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


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


PROGRAM = {"ddiloco.cli", "ddiloco.__main__"}
"""The top of the graph: the command line may reach anything (its ``chaos-suite`` command runs test scaffolding)."""
SCAFFOLDING = "ddiloco.testing"
PROCESS_BODIES = {"ddiloco.learner_worker.launch", "ddiloco.synchronizer.process", "ddiloco.synchronizer.evaluator"}
ENTRY = {"ddiloco.entry", "ddiloco.flows._forkserver_preload"}
"""Where process bodies are imported: the entry, and the warm fork server, which imports them once for its children."""


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def layering_problems(graph: dict[str, set[str]]) -> list[str]:
    """Every import that breaks the layering, one line each."""
    problems = []
    for name, targets in sorted(graph.items()):
        for target in sorted(targets):
            if target == "ddiloco.cli" and name != "ddiloco.__main__":
                problems.append(f"{name} imports the CLI, which sits above it")
            if _within(target, SCAFFOLDING) and not _within(name, SCAFFOLDING) and name not in PROGRAM:
                problems.append(f"{name} imports the test scaffolding {target}")
            if target in PROCESS_BODIES and name not in ENTRY and name not in PROCESS_BODIES:
                problems.append(f"{name} starts a process body ({target}) without ddiloco.entry's checks")
    return problems


def import_cycles(graph: dict[str, set[str]] | None = None) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    graph = import_graph() if graph is None else graph
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


def test_the_layering_rules_catch_each_kind_of_breach() -> None:
    graph = {
        "ddiloco.__main__": {"ddiloco.cli"},
        "ddiloco.cli": {"ddiloco.entry", "ddiloco.testing.chaos_suite"},
        "ddiloco.entry": {"ddiloco.learner_worker.launch"},
        "ddiloco.testing.chaos_suite": {"ddiloco.testing.net", "ddiloco.entry"},
        "ddiloco.demo": {"ddiloco.testing.net", "ddiloco.cli"},
        "ddiloco.flows.training": {"ddiloco.synchronizer.process"},
    }
    assert layering_problems(graph) == [
        "ddiloco.demo imports the CLI, which sits above it",
        "ddiloco.demo imports the test scaffolding ddiloco.testing.net",
        "ddiloco.flows.training starts a process body (ddiloco.synchronizer.process) without ddiloco.entry's checks",
    ]


@pytest.mark.timeout(60)
def test_nothing_below_the_cli_imports_it_and_the_runtime_never_imports_the_scaffolding() -> None:
    graph = import_graph()
    assert {"ddiloco.entry", "ddiloco.testing.chaos_suite"} <= graph.keys()  # the walk sees the modules the rules name
    assert layering_problems(graph) == []
