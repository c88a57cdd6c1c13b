"""Named fault-injection points for failure tests and the chaos suite.

``DDILOCO_FAULTS="learner.after_blob:3,sync.before_commit:1"`` makes the process stop dead at
the 3rd time it reaches ``learner.after_blob`` (and the 1st of ``sync.before_commit``): it writes
``$DDILOCO_FAULT_DIR/<name>`` so a test knows it is there, then blocks until it is killed. Unset,
every point is a dictionary lookup and nothing else."""

from __future__ import annotations

import os
import threading
from collections import Counter
from pathlib import Path

_counts: Counter[str] = Counter()
_lock = threading.Lock()


def _armed() -> dict[str, int]:
    spec = os.environ.get("DDILOCO_FAULTS", "")
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, nth = item.partition(":")
        out[name] = int(nth or 1)
    return out


def fault_point(name: str) -> None:
    """Block forever here if the environment arms this point for this occurrence."""
    armed = _armed()
    if name not in armed:
        return
    with _lock:
        _counts[name] += 1
        hit = _counts[name] == armed[name]
    if not hit:
        return
    marker_dir = Path(os.environ.get("DDILOCO_FAULT_DIR", "."))
    marker_dir.mkdir(parents=True, exist_ok=True)
    (marker_dir / name).write_text(str(os.getpid()))
    threading.Event().wait()
