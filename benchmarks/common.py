"""Helpers shared by the benchmarks: where results go, what machine and commit they came from, timing.

Every benchmark reports RATIOS against a baseline measured in the same run (the machine is small
and shared), prints its figures, and writes them as JSON with :func:`write_results`."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ddiloco.bench.provenance import git_state, json_safe, load_average, machine_info

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def header(name: str, args: argparse.Namespace | None = None) -> dict[str, Any]:
    """The common head of every result file: what, when, on which commit and machine."""
    h: dict[str, Any] = {
        "benchmark": name,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **git_state(),
        "machine": machine_info(),
    }
    if args is not None:
        h["args"] = {k: v for k, v in vars(args).items() if k != "json"}
    return h


QUICK_RESULTS = RESULTS / "quick"
"""Where a --quick run's results go unless --json says otherwise: never over the published ones (git ignores it)."""


def results_path(name: str, override: str | None = None, quick: bool = False) -> Path:
    if override:
        return Path(override)
    return (QUICK_RESULTS if quick else RESULTS) / f"{name}.json"


def write_results(name: str, results: dict[str, Any], override: str | None = None) -> Path:
    """Write ``results`` (after refreshing the machine's load figure) and return the path: a --quick run's (its
    ``args`` say so) under ``benchmarks/results/quick/``, so that a smoke check never overwrites a published figure."""
    results.setdefault("machine", machine_info())
    results["machine"]["load_avg_1m_end"] = load_average()
    path = results_path(name, override, quick=bool(results.get("args", {}).get("quick")))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(portable(json_safe(results)), indent=2) + "\n")
    print(f"wrote {path}")
    return path


def portable(x: Any) -> Any:
    """``x`` with this machine's paths in its strings written as placeholders (the checkout as ``<repo>``, the temp
    folder as ``<tmp>``): results are committed, and a path of the machine that measured them says nothing to a reader."""
    if isinstance(x, str):
        for path, name in ((str(ROOT), "<repo>"), (tempfile.gettempdir(), "<tmp>")):
            x = x.replace(path.rstrip("/") + "/", name + "/")
        return x
    if isinstance(x, dict):
        return {k: portable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [portable(v) for v in x]
    return x


def base_parser(doc: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a short run (< 30 s) that checks the benchmark works")
    ap.add_argument("--json", default=None, help="where to write the results (default benchmarks/results/<name>.json)")
    return ap


# --- timing -----------------------------------------------------------------------------------------


@contextmanager
def timed(sink: dict[str, float], key: str) -> Iterator[None]:
    """Add the wall time of the block to ``sink[key]``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        sink[key] = sink.get(key, 0.0) + time.perf_counter() - t0


def wrap_timed(fn: Callable[..., Any], sink: dict[str, float], key: str) -> Callable[..., Any]:
    """``fn`` that also adds its wall time to ``sink[key]`` (for instance-method patching)."""

    def wrapper(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            sink[key] = sink.get(key, 0.0) + time.perf_counter() - t0

    return wrapper


def best_of(fn: Callable[[], Any], repeats: int) -> float:
    """Shortest wall time of ``repeats`` calls."""
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def geomean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


# --- where a thread's wall time goes (Linux /proc) ----------------------------------------------------


def thread_sched(native_id: int | None = None) -> tuple[float, float] | None:
    """(seconds on CPU, seconds waiting in the run queue) of a thread of this process, from schedstat.

    Wall time minus both is time the thread was blocked (on the GIL, a lock or I/O)."""
    import threading

    tid = threading.get_native_id() if native_id is None else native_id
    try:
        cpu_ns, wait_ns, _slices = Path(f"/proc/self/task/{tid}/schedstat").read_text().split()
    except (OSError, ValueError):
        return None
    return int(cpu_ns) / 1e9, int(wait_ns) / 1e9


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process (all its threads)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def machine_busy() -> tuple[float, float] | None:
    """(busy, total) jiffies of all CPUs, from /proc/stat: the share busy between two reads is the machine's load."""
    try:
        parts = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    return sum(parts) - idle, sum(parts)


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so ``finally`` blocks run and child processes get stopped."""
    import signal

    def _exit(signum, _frame) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)
