"""What the fork server of warm launches imports once, so a learner, synchronizer or evaluator forked from it
starts in a fraction of a second instead of importing torch (and torch._dynamo, which the first torch
optimizer imports) for seconds of CPU on every launch and relaunch. See ``launchers.warm_up``.

Only the fork server imports this module: its standard streams go to /dev/null first (each child points
them at its own log), so nothing imported here takes the supervisor's terminal for its own."""

from __future__ import annotations

import multiprocessing.forkserver
import multiprocessing.spawn
import os
import sys

if getattr(sys.modules["__main__"], "main", None) is multiprocessing.forkserver.main:
    _null = os.open(os.devnull, os.O_RDWR)
    for _fd in (0, 1, 2):
        os.dup2(_null, _fd)
    os.close(_null)
    # A child of this server runs a process main (launchers._run_process), never code of the launching program's
    # __main__: it must not run that program's main module again first, as multiprocessing would (an unguarded
    # script that launches a run would start the run again in every child).
    multiprocessing.spawn._fixup_main_from_name = multiprocessing.spawn._fixup_main_from_path = lambda _main: None

# The synchronizer's merge buffers want transparent huge pages (synchronizer/process.py); torch reads the
# setting at its first allocation, which importing it makes: it must be in place before the import.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402
import torch._dynamo  # noqa: E402, F401 - imported by the first torch optimizer a process builds

import ddiloco.entry  # noqa: E402, F401
import ddiloco.flows.launchers  # noqa: E402, F401
import ddiloco.learner_worker.launch  # noqa: E402, F401
import ddiloco.synchronizer.evaluator  # noqa: E402, F401
import ddiloco.synchronizer.process  # noqa: E402, F401
