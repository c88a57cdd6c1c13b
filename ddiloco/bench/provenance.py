"""Where a benchmark's figures come from: the commit, the machine, and JSON-safe values."""

from __future__ import annotations

import hashlib
import math
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent


WRITTEN_BY_BENCHMARKS = ("benchmarks/results", "docs")
"""Tracked folders that benchmarks write into (results, published docs blocks): a change there is not a change of the
code that measured, so it does not make a later benchmark of the same run (a GPU suite's next step) 'dirty'."""


def git_state(root: Path = ROOT) -> dict[str, Any]:
    """HEAD of the checkout and whether the tree has uncommitted changes outside ``WRITTEN_BY_BENCHMARKS``."""
    out: dict[str, Any] = {"commit": None, "dirty": None}
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5, check=False)
        if head.returncode == 0:
            out["commit"] = head.stdout.strip() or None
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", *(f":(exclude){p}" for p in WRITTEN_BY_BENCHMARKS)],
            cwd=root, capture_output=True, text=True, timeout=5, check=False,
        )
        if status.returncode == 0:
            out["dirty"] = bool(status.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def code_digest(root: Path = ROOT) -> str:
    """sha256 of the package's Python sources (``ddiloco/**/*.py``, by relative path): what a result was computed
    with, the same in a git checkout, a copy without git, and after results are committed beside it."""
    digest = hashlib.sha256()
    for path in sorted((root / "ddiloco").rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def load_average() -> float | None:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def machine_info() -> dict[str, Any]:
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count()
    info: dict[str, Any] = {
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "load_avg_1m": load_average(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def json_safe(x: Any) -> Any:
    """NaN/inf become null, tuples become lists, keys become strings."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x
