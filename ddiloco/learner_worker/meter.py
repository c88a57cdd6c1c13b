"""What a learner's link measures of itself: the transfers it completed and the rates they show."""

from __future__ import annotations

import bisect
import math
import threading
from collections import deque
from typing import NamedTuple

from ddiloco.learner_worker.cadence import LinkRates


class _Transfer(NamedTuple):
    end: float
    seconds: float
    nbytes: int
    seconds_before: float
    """Seconds of the transfers kept before this one, since the meter began (window sums are differences)."""
    nbytes_before: int


def _end(t: _Transfer) -> float:
    return t.end


class _Done:
    """One direction's completed transfers, the newest ``keep``, in the order they ended, with running totals: a
    window's sums cost a binary search, not a pass over every transfer (the training thread asks at every step)."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.items: deque[_Transfer] = deque()
        self.longest = 0.0
        """The longest transfer kept: only those ending within this long of a window's opening can have begun before it."""

    def add(self, end: float, seconds: float, nbytes: int) -> None:
        items = self.items
        if items and end < items[-1].end:
            # Out of order (a clock stepped back): keep the ends sorted, with the running totals rebuilt.
            kept = sorted([(t.end, t.seconds, t.nbytes) for t in items] + [(end, seconds, nbytes)])
            items.clear()
            self.longest = 0.0
            for e, s, n in kept:
                self._append(e, s, n)
        else:
            self._append(end, seconds, nbytes)
        while len(items) > self.keep:
            if items.popleft().seconds >= self.longest:
                self.longest = max((t.seconds for t in items), default=0.0)

    def _append(self, end: float, seconds: float, nbytes: int) -> None:
        last = self.items[-1] if self.items else None
        before = (last.seconds_before + last.seconds, last.nbytes_before + last.nbytes) if last else (0.0, 0)
        self.items.append(_Transfer(end, seconds, nbytes, *before))
        self.longest = max(self.longest, seconds)

    def window(self, opens: float) -> tuple[float, float, int, int]:
        """(busy seconds inside the window opening at ``opens``, seconds and bytes of the transfers that ended in it,
        how many did)."""
        items = self.items
        i = bisect.bisect_left(items, opens, key=_end)
        if i == len(items):
            return 0.0, 0.0, 0, 0
        first, last = items[i], items[-1]
        seconds = last.seconds_before + last.seconds - first.seconds_before
        nbytes = last.nbytes_before + last.nbytes - first.nbytes_before
        busy = seconds
        # Those that began before the window opened count only their part inside it.
        for j in range(i, len(items)):
            t = items[j]
            if t.end >= opens + self.longest:
                break
            if t.end - t.seconds < opens:
                busy -= t.seconds - (t.end - opens)
        return busy, seconds, nbytes, len(items) - i

    def newest(self, n: int) -> tuple[float, int, int]:
        """(seconds, bytes, how many) of the newest ``n`` transfers."""
        items = self.items
        if not items:
            return 0.0, 0, 0
        # The running totals give the sums without a pass over (or a copy of) the kept transfers.
        first, last = items[max(0, len(items) - n)], items[-1]
        return (last.seconds_before + last.seconds - first.seconds_before, last.nbytes_before + last.nbytes - first.nbytes_before,
                min(n, len(items)))


class LinkMeter:
    """The transfers a link completed (the newest ``keep`` each way) and those under way, and the rates
    they show over a window. Directions: ``up`` (submissions) and ``down`` (global versions)."""

    def __init__(self, start: float, keep: int = 256) -> None:
        self.start = start
        self._lock = threading.Lock()
        self._done: dict[str, _Done] = {d: _Done(keep) for d in ("up", "down")}
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
                self._done[direction].add(now, max(0.0, seconds), nbytes)

    def rates(self, now: float, window_s: float) -> LinkRates:
        """Bytes/s while transferring and the busy share, each way, over the last ``window_s`` (a rate falls
        back to the newest few transfers when none ended in the window: a slow link still has one)."""
        span = max(1e-9, min(window_s, now - self.start))
        out: dict[str, tuple[float | None, float]] = {}
        with self._lock:
            for d, done in self._done.items():
                busy, seconds, nbytes, count = done.window(now - span)
                busy += sum(min(now - t0, span) for dd, t0 in self._active.values() if dd == d)
                if not count:
                    seconds, nbytes, count = done.newest(4)
                rate = None if not count else (nbytes / seconds if seconds > 0 else math.inf)
                out[d] = (rate, min(1.0, busy / span))
        return LinkRates(out["up"][0], out["down"][0], out["up"][1], out["down"][1], span)
