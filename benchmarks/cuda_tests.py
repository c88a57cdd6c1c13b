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

NEEDS_GPU = re.compile(r"\bcuda\b|\bgpus?\b", re.IGNORECASE)
JSON_ENV = "CUDA_TESTS_JSON"

_outcomes: dict[str, str] = {}


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


def pytest_collection_modifyitems(config, items) -> None:
    keep = [item for item in items if needs_gpu(item)]
    dropped = [item for item in items if not needs_gpu(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def pytest_runtest_logreport(report) -> None:
    # A failure in setup or teardown counts; a pass needs the call phase.
    if report.failed or report.skipped or report.when == "call":
        _outcomes.setdefault(report.nodeid, "failed" if report.failed else "skipped" if report.skipped else "passed")


def pytest_sessionfinish(session, exitstatus) -> None:
    path = os.environ.get(JSON_ENV)
    if not path:
        return
    import torch

    counts = {k: sum(1 for v in _outcomes.values() if v == k) for k in ("passed", "failed", "skipped")}
    data = {
        "benchmark": "cuda_tests",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "exit_status": int(exitstatus),
        "counts": counts,
        "tests": dict(sorted(_outcomes.items())),
        # Skips are listed, not judged: on a GPU the CPU-side refusal checks skip by design.
        "goal": {"measure": "no GPU test fails, and some ran", "pass": counts["failed"] == 0 and counts["passed"] > 0},
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    print(" ".join(str(p) for p in gpu_test_files(sys.argv[1] if len(sys.argv) > 1 else "tests")))
