"""Freed heap memory goes back to the system (ddiloco/platform/memory.py): a long-lived learner or synchronizer
would otherwise keep every burst's high-water mark resident."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ddiloco.platform.memory import HAVE_MALLOC_TRIM, HeapTrimmer

BURST = """
from ddiloco.platform.memory import release_free_heap

def anon_mib():
    return int(next(line for line in open("/proc/self/status") if line.startswith("RssAnon")).split()[1]) >> 10

burst = [bytes(1000) + bytes([i % 256]) for i in range(100_000)]  # ~100 MiB of malloc'd chunks, not pymalloc's
pin = bytes(1000) + b"pin"  # allocated above the burst: the heap's top cannot shrink past it
peak = anon_mib()
del burst
freed = anon_mib()
released = release_free_heap()
print(peak, freed, anon_mib(), released)
"""


@pytest.mark.skipif(not (sys.platform.startswith("linux") and HAVE_MALLOC_TRIM), reason="needs Linux and glibc's malloc_trim")
def test_a_burst_freed_below_a_live_chunk_stays_resident_until_trimmed():
    out = subprocess.run([sys.executable, "-c", BURST], capture_output=True, text=True, check=True).stdout.split()
    peak, freed, trimmed, released = int(out[0]), int(out[1]), int(out[2]), out[3]
    assert freed > peak - 20, (peak, freed)  # free() alone kept the burst resident: the leak-like step
    assert released == "True" and trimmed < freed - 80, (peak, freed, trimmed)


def test_the_trimmer_trims_at_most_every_interval_of_its_clock():
    trimmer = HeapTrimmer(every_s=30.0)
    assert [trimmer.maybe(t) for t in (100.0, 110.0, 129.9, 130.0, 140.0, 160.0, 200.0)] == [
        False, False, False, True, False, True, True]
