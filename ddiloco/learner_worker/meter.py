"""What a learner's link measures of itself: the transfers it completed and the rates they show."""

from __future__ import annotations

import math
import threading
from collections import deque

from ddiloco.learner_worker.cadence import LinkRates


class LinkMeter:
    """The transfers a link completed (the newest ``keep`` each way) and those under way, and the rates
    they show over a window. Directions: ``up`` (submissions) and ``down`` (global versions)."""

    def __init__(self, start: float, keep: int = 256) -> None:
        self.start = start
        self._lock = threading.Lock()
        self._done: dict[str, deque[tuple[float, float, int]]] = {d: deque(maxlen=keep) for d in ("up", "down")}
        self._active: dict[int, tuple[str, float]] = {}
        self._next = 0

    def begin(self, direction: str, now: float) -> int:
        """A transfer starts at ``now``; the token ends it."""
        with self._lock:
            self._next += 1
            self._active[self._next] = (direction, now)
            return self._next

    def end(self, token: int, nbytes: int, seconds: float, now: float) -> None:
        """The transfer of ``token`` moved ``nbytes`` in ``seconds`` and ended at ``now`` (0 bytes: it failed)."""
        with self._lock:
            direction, _ = self._active.pop(token)
            if nbytes > 0:
                self._done[direction].append((now, max(0.0, seconds), nbytes))

    def rates(self, now: float, window_s: float) -> LinkRates:
        """Bytes/s while transferring and the busy share, each way, over the last ``window_s`` (a rate falls
        back to the newest few transfers when none ended in the window: a slow link still has one)."""
        span = max(1e-9, min(window_s, now - self.start))
        out: dict[str, tuple[float | None, float]] = {}
        with self._lock:
            for d, done in self._done.items():
                recent = [t for t in done if t[0] >= now - span]
                busy = sum(min(sec, end - (now - span)) for end, sec, _ in recent)
                busy += sum(min(now - t0, span) for dd, t0 in self._active.values() if dd == d)
                sample = recent or list(done)[-4:]
                seconds, nbytes = sum(t[1] for t in sample), sum(t[2] for t in sample)
                rate = None if not sample else (nbytes / seconds if seconds > 0 else math.inf)
                out[d] = (rate, min(1.0, busy / span))
        return LinkRates(out["up"][0], out["down"][0], out["up"][1], out["down"][1], span)
