"""Print the digest of what constraints.txt is generated from: pyproject's requirements and constraints.in's pins."""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def lock_inputs(root: Path = ROOT) -> dict:
    """The requirement sets the lock is resolved from, in a canonical form (comments and order ignored)."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    pins = [line.split("#", 1)[0].strip() for line in (root / "constraints.in").read_text().splitlines()]
    return {
        "requires-python": project.get("requires-python", ""),
        "dependencies": sorted(project.get("dependencies", [])),
        "optional-dependencies": {k: sorted(v) for k, v in sorted(project.get("optional-dependencies", {}).items())},
        "constraints": sorted(p for p in pins if p),
    }


def digest(root: Path = ROOT) -> str:
    return hashlib.sha256(json.dumps(lock_inputs(root), sort_keys=True).encode()).hexdigest()


if __name__ == "__main__":
    print(digest())
