"""Handing freed heap memory back to the operating system, for processes that live for days.

glibc's malloc returns memory to the system only from the top of its heaps. A burst (a partition's coalesced
fragments, a catch-up download after an outage, a takeover's state) raises a heap's high-water mark, and what is
freed below a chunk still in use stays resident: RSS then keeps every peak the process ever had, a step at a time.
``malloc_trim(0)`` releases every free page inside the heaps. Where there is no glibc (musl, macOS) nothing is done."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

TRIM_EVERY_S = 30.0
"""Often enough that a burst's pages go back within a poll or two of a heartbeat; each trim walks the free lists
(milliseconds for a few hundred MB of heap), off the training thread."""


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim  # this process's own symbols: glibc's when it is linked
    except (AttributeError, OSError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_TRIM = _malloc_trim()
HAVE_MALLOC_TRIM = _TRIM is not None


def release_free_heap() -> bool:
    """Give the heaps' free pages back to the system; whether anything was released (False without glibc)."""
    return bool(_TRIM(0)) if _TRIM is not None else False


class HeapTrimmer:
    """Calls :func:`release_free_heap` at most every ``every_s`` seconds of the clock it is handed."""

    def __init__(self, every_s: float = TRIM_EVERY_S) -> None:
        self.every_s = every_s
        self._last: float | None = None

    def maybe(self, now: float) -> bool:
        """Trim when ``every_s`` has passed since the last trim (the first call only starts the clock); whether it did."""
        if self._last is None:
            self._last = now
            return False
        if now - self._last < self.every_s:
            return False
        self._last = now
        try:
            release_free_heap()
        except Exception:  # noqa: BLE001 - memory housekeeping must never stop a learner or a synchronizer
            log.exception("malloc_trim failed")
        return True
