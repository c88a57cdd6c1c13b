"""constraints.txt is the lock of pyproject.toml: generated from it, consistent with it, and what is installed."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PIN = re.compile(r"^([A-Za-z0-9_.-]+)==([^\s;]+)\s*(?:;\s*(.+))?$")


def _lock_inputs():
    spec = importlib.util.spec_from_file_location("lock_inputs", ROOT / "infra" / "lock_inputs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pins_here() -> dict[str, Version]:
    """The lock's pin of each package whose marker holds on this interpreter."""
    pins: dict[str, Version] = {}
    env = default_environment()
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        m = PIN.match(line.strip())
        if not m:
            continue
        name, version, marker = m.groups()
        if marker and not Requirement(f"x; {marker}").marker.evaluate(env):
            continue
        assert canonicalize_name(name) not in pins, f"two pins of {name} hold here"
        pins[canonicalize_name(name)] = Version(version)
    return pins


def test_lock_was_generated_from_the_current_inputs():
    header = (ROOT / "constraints.txt").read_text().split("\n", 5)[:5]
    recorded = next((line.split(":", 1)[1].strip() for line in header if line.startswith("# inputs-sha256:")), None)
    assert recorded == _lock_inputs().digest(ROOT), "constraints.txt is stale: run 'bash infra/lock.sh'"


def test_every_requirement_of_every_extra_is_pinned_within_its_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _pins_here()
    env = default_environment()
    requirements = list(project["dependencies"])
    for reqs in project["optional-dependencies"].values():
        requirements += reqs
    hand = [ln.split("#", 1)[0].strip() for ln in (ROOT / "constraints.in").read_text().splitlines()]
    requirements += [h for h in hand if h]
    checked = 0
    for text in requirements:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if name == "ddiloco" or (req.marker and not req.marker.evaluate(env | {"extra": ""})):
            continue
        assert name in pins, f"{req.name} is required but not in the lock"
        assert req.specifier.contains(pins[name], prereleases=True), f"lock pins {req.name}=={pins[name]}, outside {req}"
        checked += 1
    assert checked > 20


def test_installed_environment_is_the_lock():
    """The README's install (pip -c constraints.txt) put exactly the locked versions here."""
    pins = _pins_here()
    wrong = []
    for dist in importlib.metadata.distributions():
        if "_vendor" in Path(str(dist.locate_file(""))).parts:
            continue  # a copy another package carries for itself (setuptools puts its _vendor on sys.path), not installed
        name = canonicalize_name(dist.metadata["Name"])
        if name in pins and Version(Version(dist.version).public) != pins[name]:
            wrong.append(f"{name} {dist.version} (lock {pins[name]})")
    assert "torch" in pins and not wrong, f"installed versions differ from constraints.txt: {wrong}"
