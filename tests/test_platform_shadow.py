"""Our ``ddiloco.platform`` package must never shadow the standard library's ``platform`` module."""

from __future__ import annotations

import importlib
import platform as std_platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_stdlib_platform_from_repo_root():
    # From the repo root (cwd first on sys.path for -c), "import platform" is still the stdlib one.
    out = subprocess.run(
        [sys.executable, "-c", "import platform; print(platform.system()); print(platform.__file__)"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    )
    system, path = out.stdout.splitlines()
    assert system == std_platform.system() and system in ("Linux", "Darwin", "Windows")
    assert not Path(path).resolve().is_relative_to(ROOT / "ddiloco")


def test_ddiloco_platform_is_a_different_module():
    ours = importlib.import_module("ddiloco.platform")
    assert ours is not std_platform
    assert Path(ours.__file__).resolve().parent == ROOT / "ddiloco" / "platform"
    assert hasattr(std_platform, "system") and not hasattr(ours, "system")
    assert sys.modules["platform"] is std_platform
