"""Handing freed heap memory back to the operating system, for processes that live for days.

glibc's malloc returns memory to the system only from the top of its heaps. A burst (a partition's coalesced
fragments, a catch-up download after an outage, a takeover's state) raises a heap's high-water mark, and what is
freed below a chunk still in use stays resident: RSS then keeps every peak the process ever had, a step at a time.
``malloc_trim(0)`` releases every free page inside the heaps. Where there is no glibc (musl, macOS) nothing is done.

A benchmark process of minutes wants the opposite, freed memory kept for its next allocation: :func:`keep_freed_memory`."""

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


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
"""glibc's mallopt parameters (malloc.h)."""


def keep_freed_memory() -> bool:
    """The opposite trade, for a process of minutes that allocates and frees the same large buffers over and over (an
    in-process run of eight learners trading float32 blobs of a 30M-parameter model): keep what is freed for the next
    allocation; whether glibc took the settings (False without it).

    glibc serves every block over 32 MiB with an mmap of its own and unmaps it when it is freed, so each new one is
    memory the kernel faults in and zeroes page by page. On the virtual machines these benchmarks run on, that first
    touch moved 0.45 GB/s where copying warm memory moved 13 GB/s, and a synchronous round of the GPU quality plan
    spent most of its host time there. With mmap off and the heap's top kept, those blocks come from the heap and are
    reused. The process's resident memory then stays at its peak, which is why long-lived processes trim instead."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    took = [mallopt(M_MMAP_MAX, 0), mallopt(M_TRIM_THRESHOLD, 2**31 - 1)]  # both set, whatever the first says
    return all(took)
