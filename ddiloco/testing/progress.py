"""Watching a run make progress: when a counter grew, and the longest stretch it did not."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence


def longest_gap(times: Sequence[float], excused: Sequence[tuple[float, float]] = ()) -> tuple[float, float]:
    """(longest interval between consecutive ``times`` that overlaps no ``excused`` window, its start); (0, 0) if none."""
    worst, at = 0.0, 0.0
    for a, b in zip(times, times[1:]):
        if any(a < end and b > start for start, end in excused):
            continue
        if b - a > worst:
            worst, at = b - a, a
    return worst, at


class ProgressMonitor(threading.Thread):
    """Samples ``count()`` every ``every_s`` and records (monotonic) when it grew."""

    def __init__(self, count: Callable[[], int], every_s: float) -> None:
        super().__init__(name="progress-monitor", daemon=True)
        self.count, self.every_s = count, every_s
        self.grew_at: list[float] = []
        self._halt = threading.Event()

    def run(self) -> None:
        last = -1
        while not self._halt.wait(self.every_s):
            try:
                n = self.count()
            except Exception:  # noqa: BLE001 - a backend may be restarting; the next sample sees it
                continue
            if n > last:
                self.grew_at.append(time.monotonic())
                last = n

    def stop(self) -> None:
        self._halt.set()
        if self.ident is not None:
            self.join(timeout=10)

    def longest_gap(self, excused: Sequence[tuple[float, float]] = ()) -> tuple[float, float]:
        return longest_gap(self.grew_at, excused)
