"""Named fault-injection points for failure tests and the chaos suite.

``DDILOCO_FAULTS="learner.after_blob:3,sync.before_commit:1"`` makes the process stop dead at
the 3rd time it reaches ``learner.after_blob`` (and the 1st of ``sync.before_commit``): it writes
``$DDILOCO_FAULT_DIR/<name>`` so a test knows it is there, then blocks until it is killed.
``name:file`` arms a point from outside, at a moment of the tester's choosing: the point fires
the first time it is reached after the file ``$DDILOCO_FAULT_DIR/arm/<name>`` appears (and
removes it). Unset, every point is a dictionary lookup and nothing else."""

from __future__ import annotations

import os
import threading
from collections import Counter
from pathlib import Path

_counts: Counter[str] = Counter()
_lock = threading.Lock()
ARMED_BY_FILE = "file"


def _armed() -> dict[str, str]:
    spec = os.environ.get("DDILOCO_FAULTS", "")
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, nth = item.partition(":")
        out[name] = nth or "1"
    return out


def arm_file(fault_dir: Path, name: str) -> Path:
    """The file that arms point ``name`` of a process started with ``name:file``."""
    return Path(fault_dir) / "arm" / name


def _fires(name: str, when: str, marker_dir: Path) -> bool:
    if when == ARMED_BY_FILE:
        trigger = arm_file(marker_dir, name)
        with _lock:
            if not trigger.exists():
                return False
            trigger.unlink(missing_ok=True)
            return True
    with _lock:
        _counts[name] += 1
        return _counts[name] == int(when)


def fault_point(name: str) -> None:
    """Block forever here if the environment arms this point for this occurrence."""
    armed = _armed()
    if name not in armed:
        return
    marker_dir = Path(os.environ.get("DDILOCO_FAULT_DIR", "."))
    if not _fires(name, armed[name], marker_dir):
        return
    marker_dir.mkdir(parents=True, exist_ok=True)
    (marker_dir / name).write_text(str(os.getpid()))
    threading.Event().wait()
