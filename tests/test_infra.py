"""infra/ must stay usable: the compose stack parses, prefect.yaml's deployments point at real flows
with a valid cron schedule, and the work-pool variable files parse."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import yaml
from prefect.client.schemas.schedules import CronSchedule
from sqlalchemy.engine import make_url

INFRA = Path(__file__).resolve().parent.parent / "infra"


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
