"""Handing freed heap memory back to the operating system, for processes that live for days.

glibc's malloc returns memory to the system only from the top of its heaps. A burst (a partition's coalesced
fragments, a catch-up download after an outage, a takeover's state) raises a heap's high-water mark, and what is
freed below a chunk still in use stays resident: RSS then keeps every peak the process ever had, a step at a time.
``malloc_trim(0)`` releases every free page inside the heaps. Where there is no glibc (musl, macOS) nothing is done."""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

TRIM_EVERY_S = 30.0
"""Often enough that a burst's pages go back soon after it; each trim walks the free lists (milliseconds for a few
hundred MB of heap) on its own thread, never the training thread's."""


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


_lock = threading.Lock()
_thread: threading.Thread | None = None


def start_heap_trimmer(every_s: float = TRIM_EVERY_S) -> bool:
    """Start this process's trimming thread, once (a daemon: it never holds the process up); whether it started now.
    Every process main calls it, so each rank of a multi-rank learner trims its own heap."""
    global _thread
    with _lock:
        if _TRIM is None or (_thread is not None and _thread.is_alive()):
            return False
        _thread = threading.Thread(target=_trim_every, args=(every_s,), name="heap-trimmer", daemon=True)
        _thread.start()
        return True


def _trim_every(every_s: float) -> None:
    tick = threading.Event()
    while not tick.wait(every_s):
        try:
            release_free_heap()
        except Exception:  # noqa: BLE001 - memory housekeeping must never take a process down
            log.exception("malloc_trim failed")
