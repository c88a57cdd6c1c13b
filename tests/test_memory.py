"""Freed heap memory goes back to the system (ddiloco/platform/memory.py): a long-lived learner or synchronizer
would otherwise keep every burst's high-water mark resident."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest

from ddiloco.platform.memory import HAVE_MALLOC_TRIM

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


THREAD = """
import json, threading, time
from ddiloco.platform.memory import start_heap_trimmer

def anon_mib():
    return int(next(line for line in open("/proc/self/status") if line.startswith("RssAnon")).split()[1]) >> 10

burst = [bytes(1000) + bytes([i % 256]) for i in range(100_000)]
pin = bytes(1000) + b"pin"
del burst
freed = anon_mib()
started = [start_heap_trimmer(every_s=0.05), start_heap_trimmer(every_s=0.05)]
deadline = time.monotonic() + 20
while anon_mib() > freed - 80 and time.monotonic() < deadline:
    time.sleep(0.05)
trimmers = [t.daemon for t in threading.enumerate() if t.name == "heap-trimmer"]
print(json.dumps({"freed": freed, "after": anon_mib(), "started": started, "trimmers": trimmers}))
"""


@pytest.mark.skipif(not (sys.platform.startswith("linux") and HAVE_MALLOC_TRIM), reason="needs Linux and glibc's malloc_trim")
def test_the_process_trimmer_is_one_daemon_thread_that_gives_a_freed_burst_back():
    out = subprocess.run([sys.executable, "-c", THREAD], capture_output=True, text=True, check=True, timeout=60).stdout
    got = json.loads(out)
    assert got["after"] < got["freed"] - 80, got  # no call from this code: the thread gave the burst back
    assert got["started"] == [True, False] and got["trimmers"] == [True], got  # once per process, a daemon


REUSE = """
import resource, sys
from ddiloco.platform.memory import keep_freed_memory

kept = keep_freed_memory() if sys.argv[1] == "keep" else None
faults = []
for i in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blob = bytes([i + 1]) * (64 << 20)  # a float32 blob's worth, written page by page
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del blob
print(kept, sum(faults[1:]))
"""


@pytest.mark.skipif(not (sys.platform.startswith("linux") and HAVE_MALLOC_TRIM), reason="needs Linux and glibc's mallopt")
def test_a_benchmark_process_reuses_a_freed_large_block_instead_of_faulting_in_fresh_pages():
    def faults(mode: str) -> tuple[str, int]:
        out = subprocess.run([sys.executable, "-c", REUSE, mode], capture_output=True, text=True, check=True, timeout=60).stdout.split()
        return out[0], int(out[1])

    pages = (64 << 20) // resource.getpagesize()
    plain, kept = faults("plain"), faults("keep")
    assert plain[1] > 3 * pages // 2, plain  # glibc's default: each 64 MiB block is a fresh mmap, faulted in again
    assert kept[0] == "True" and kept[1] < pages // 8, kept  # the freed block came back from the heap, already resident
