"""A pytest plugin that keeps only the tests written for a GPU, and writes their outcomes as JSON.

The repository has no ``cuda`` marker: a test that needs a GPU says so in its skip condition,
``@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device ...")``. This plugin keeps
the tests whose ``skipif`` reason names CUDA or a GPU (a few CPU-side checks of the CUDA paths come along,
such as the refusal without a GPU; on a GPU machine they skip) and deselects the rest, so a new GPU test is
picked up without a list to keep in step. ``gpu_suite.sh`` uses it:

    PYTHONPATH=benchmarks python -m pytest -p cuda_tests $(python benchmarks/cuda_tests.py tests)
    # CUDA_TESTS_JSON=out.json to write outcomes

Run as a script, it prints the test files to collect: those with a ``skipif`` whose reason names CUDA or a GPU, read
from their source, never imported (the GPU image lacks what other files import: prefect, moto...).
"""

from __future__ import annotations

import ast
import json
import os
import re
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

NEEDS_GPU = re.compile(r"\bcuda\b|\bgpus?\b", re.IGNORECASE)
JSON_ENV = "CUDA_TESTS_JSON"

_outcomes: dict[str, str] = {}
_seconds: dict[str, float] = {}
_selected: list[str] = []
_worker = False
"""Whether this process is an xdist worker: only the process that sees every test's report writes the record."""


def needs_gpu(item) -> bool:
    return any(NEEDS_GPU.search(str(m.kwargs.get("reason", ""))) for m in item.iter_markers("skipif"))


def _literal_text(node: ast.expr, names: dict[str, str]) -> str:
    """The literal parts of a reason: a string, an f-string's constant pieces, or a module-level name bound to one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
    if isinstance(node, ast.Name):
        return names.get(node.id, "")
    return ""


def gpu_test_files(folder: str | Path) -> list[Path]:
    """The ``test_*.py`` files of ``folder`` with a ``skipif(..., reason=...)`` whose reason names CUDA or a GPU,
    however the call is laid out (a decorator, a ``pytest.param`` mark, over several lines, a reason kept in a name)."""
    out = []
    for path in sorted(Path(folder).glob("test_*.py")):
        tree = ast.parse(path.read_text(), str(path))
        names = {t.id: _literal_text(node.value, {}) for node in tree.body if isinstance(node, ast.Assign)
                 for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "skipif" and any(
                    k.arg == "reason" and NEEDS_GPU.search(_literal_text(k.value, names)) for k in node.keywords):
                out.append(path)
                break
    return out


def pytest_configure(config) -> None:
    global _worker
    _worker = hasattr(config, "workerinput")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids) -> None:
    # Under xdist the controller collects nothing itself: its workers' (already filtered) collections say what runs.
    _selected[:] = list(dict.fromkeys([*_selected, *ids]))


def pytest_collection_modifyitems(config, items) -> None:
    keep = [item for item in items if needs_gpu(item)]
    dropped = [item for item in items if not needs_gpu(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    _selected[:] = [item.nodeid for item in keep]


def pytest_runtest_logreport(report) -> None:
    # A failure in setup or teardown counts; a pass needs the call phase.
    _seconds[report.nodeid] = round(_seconds.get(report.nodeid, 0.0) + report.duration, 2)
    if report.failed or report.skipped or report.when == "call":
        _outcomes.setdefault(report.nodeid, "failed" if report.failed else "skipped" if report.skipped else "passed")
    if report.when == "teardown":
        # Written after every test: a step cut short by its cap still leaves what ran (and what did not).
        _write(None)


def pytest_sessionfinish(session, exitstatus) -> None:
    _write(int(exitstatus))


def _write(exitstatus: int | None) -> None:
    path = os.environ.get(JSON_ENV)
    if not path or _worker:
        return
    import torch

    counts = {k: sum(1 for v in _outcomes.values() if v == k) for k in ("passed", "failed", "skipped")}
    data = {
        "benchmark": "cuda_tests",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "exit_status": exitstatus,
        "complete": exitstatus is not None,
        "counts": counts,
        "tests": dict(sorted(_outcomes.items())),
        "seconds": dict(sorted(_seconds.items())),
        "not_run": [n for n in _selected if n not in _outcomes],
        # Skips are listed, not judged: on a GPU the CPU-side refusal checks skip by design.
        "goal": {"measure": "every GPU test ran, none failed, some passed",
                 "pass": exitstatus is not None and counts["failed"] == 0 and counts["passed"] > 0},
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


if __name__ == "__main__":
    print(" ".join(str(p) for p in gpu_test_files(sys.argv[1] if len(sys.argv) > 1 else "tests")))
