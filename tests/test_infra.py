"""infra/ must stay usable: the compose stack parses, prefect.yaml's deployments point at real flows
with a valid cron schedule, and the work-pool variable files parse."""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from prefect.client.schemas.schedules import CronSchedule
from sqlalchemy.engine import make_url

ROOT = Path(__file__).resolve().parent.parent
INFRA = ROOT / "infra"


def test_compose_stack_has_the_services_and_parses():
    compose = yaml.safe_load((INFRA / "compose.yaml").read_text())
    services = compose["services"]
    assert {"postgres", "s3", "prefect-server", "worker-us", "worker-eu", "dashboard"} <= set(services)
    assert "--pool region-us" in services["worker-us"]["command"]
    assert services["worker-eu"]["environment"]["DDILOCO_LEDGER_URL"].startswith("postgresql+psycopg://")


def test_prefect_yaml_deployments_resolve_to_flows_and_the_cron_is_valid():
    spec = yaml.safe_load((INFRA / "prefect.yaml").read_text())
    names = {d["name"] for d in spec["deployments"]}
    assert {"learner-us", "learner-eu", "synchronizer", "training-run", "chaos", "evaluate"} <= names
    for d in spec["deployments"]:
        path, func = d["entrypoint"].split(":")
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        flow = getattr(module, func)
        assert hasattr(flow, "fn"), f"{d['entrypoint']} is not a Prefect flow"
        assert d["work_pool"]["name"].startswith("region-")
    nightly = next(d for d in spec["deployments"] if d["name"] == "training-run")
    CronSchedule(cron=nightly["schedules"][0]["cron"], timezone="UTC")
    from ddiloco.platform.config import build_config

    build_config(nightly["parameters"]["config"])  # the scheduled run's parameters validate


def test_work_pool_variable_files_parse_and_carry_no_credentials():
    for path in sorted((INFRA / "work-pools").glob("*.json")):
        data = json.loads(path.read_text())
        env = data["job_variables"]["env"]
        assert set(env) == {"DDILOCO_LEDGER__URL", "DDILOCO_STORAGE__URL"}
        assert make_url(env["DDILOCO_LEDGER__URL"]).password is None, f"{path.name} carries a password"


def _other_interpreter(version: str) -> str | None:
    """A Python ``version`` interpreter on this machine (PATH, or pyenv's versions), if any."""
    found = shutil.which(f"python{version}")
    if found and subprocess.run([found, "--version"], capture_output=True).returncode == 0:
        return found
    pyenv = shutil.which("pyenv")
    if pyenv:
        root = subprocess.run([pyenv, "root"], capture_output=True, text=True).stdout.strip()
        for candidate in sorted(Path(root, "versions").glob(f"{version}.*/bin/python")):
            return str(candidate)
    return None


def test_pip_refuses_python_3_10_as_pyproject_claims(tmp_path):
    """requires-python >= 3.11 (config reads TOML with the standard library's tomllib): pip on 3.10 refuses."""
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert spec == ">=3.11" and sys.version_info >= (3, 11)
    py310 = _other_interpreter("3.10")
    if py310 is None:
        pytest.skip("no Python 3.10 interpreter on this machine")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
                   check=True, capture_output=True, cwd=tmp_path)
    out = subprocess.run([py310, "-m", "pip", "install", "--dry-run", "--no-deps", "--no-index", "--find-links", str(tmp_path), "ddiloco"],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "requires a different Python" in out.stderr, out.stderr


def test_extras_fit_the_roles_and_a_learner_runs_without_prefect_or_matplotlib():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(meta["dependencies"])
    assert "prefect" not in core and "matplotlib" not in core and "streamlit" not in core
    extras = meta["optional-dependencies"]
    assert any(d.startswith("prefect") for d in extras["flows"]) and "flows" in extras["dev"][0]
    blocked = "import sys; sys.modules.update(prefect=None, matplotlib=None, streamlit=None); "
    code = blocked + "import ddiloco.cli, ddiloco.learner_worker.launch, ddiloco.synchronizer.process, ddiloco.flows.runner"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
