"""Named timing spans in the code itself: where a learner's and a synchronizer's time goes.

``with span("learner.train_step"): …`` marks a region for ``torch.profiler`` (``record_function``, while a
profiler is on) and, while a :func:`collecting` block is open anywhere in the process, adds its wall time and call
count to that block's totals. Benchmarks read the totals; nothing is patched from outside."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_lock = threading.Lock()
_totals: dict[str, float] | None = None


@contextmanager
def span(name: str, into: dict[str, float] | None = None) -> Iterator[None]:
    """Time the block under ``name``; ``into`` also keeps the seconds in a caller's own totals."""
    # record_function costs a dispatcher call in and out (7 us a span on a fast CPU, spans at every step and every
    # send): only while a profiler records.
    with torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else _NO_RECORD:
        if _totals is None and into is None:
            yield
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - t0
            if into is not None:
                into[name] = into.get(name, 0.0) + seconds
            add(name, seconds)


_NO_RECORD = contextlib.nullcontext()


def add(name: str, seconds: float, calls: int = 1) -> None:
    """Count ``seconds`` under ``name`` (and ``calls`` under ``name.calls``) if collecting."""
    totals = _totals
    if totals is None:
        return
    with _lock:
        totals[name] = totals.get(name, 0.0) + seconds
        totals[name + ".calls"] = totals.get(name + ".calls", 0.0) + calls


@contextmanager
def collecting() -> Iterator[dict[str, float]]:
    """Collect every span's totals while the block runs (one collector at a time per process)."""
    global _totals
    if _totals is not None:
        raise RuntimeError("span totals are already being collected")
    totals: dict[str, float] = {}
    _totals = totals
    try:
        yield totals
    finally:
        _totals = None
