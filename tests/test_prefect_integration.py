"""The real thing, as infra/compose.yaml runs it: a Prefect server on PostgreSQL (its own database,
beside the ledger's on the same server), work pools from infra/work-pools' templates, deployments that
carry secret names and never values, each of the alerts' automations firing a real notification, and a
training-run triggered with ``prefect deployment run``. The README's Orchestration commands run as its
text writes them (ddiloco.testing.readme reads them from the README).

One Prefect server serves the module. Docker cannot run here (no daemon), so the compose services'
commands run as processes, with the compose file's own URLs pointed at this machine's PostgreSQL and S3."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.engine import make_url
from support import tiny_config, wait_for
from typer.testing import CliRunner

from ddiloco.cli import app
from ddiloco.platform.ledger import open_ledger, session_factory
from ddiloco.platform.ledger import reports as reports_q
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger.engine import reader_of
from ddiloco.testing.compose import INFRA, dotenv, localize_url, render_compose, service_command
from ddiloco.testing.net import Webhook, free_port
from ddiloco.testing.postgres import scratch_database
from ddiloco.testing.prefect import PrefectServer, healthy, prefect_server
from ddiloco.testing.processes import stop_processes, write_config
from ddiloco.testing.readme import README, readme_command

if TYPE_CHECKING:
    from prefect.client.schemas.responses import DeploymentResponse

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

PASSWORD = "pw-planted-in-the-block-5e2d"
ROOT = README.parent


@dataclass
class Stack:
    compose: dict
    server: PrefectServer
    postgres: str
    databases: dict[str, str]
    """compose database name -> the scratch database standing in for it"""
    work: Path

    def url(self, compose_url: str) -> str:
        return localize_url(compose_url, self.postgres, self.databases)


@pytest.fixture(scope="module")
def stack(postgres_url, tmp_path_factory):
    compose = render_compose()
    work = tmp_path_factory.mktemp("stack")
    with scratch_database(postgres_url, "ddiloco_prefect") as prefect_db, scratch_database(postgres_url, "ddiloco_ledger") as ledger_db:
        databases = {"prefect": make_url(prefect_db).database, "ddiloco": make_url(ledger_db).database}
        server_env = compose["services"]["prefect-server"]["environment"]
        database_url = localize_url(server_env["PREFECT_API_DATABASE_CONNECTION_URL"], postgres_url, databases)
        with prefect_server(work, database_url=database_url, command=service_command(compose, "prefect-server")) as server:
            yield Stack(compose, server, postgres_url, databases, work)


def compose_env(stack: Stack, service: str, s3_endpoint: str) -> dict[str, str]:
    """A compose service's environment with the stack's hostnames replaced by this machine's services."""
    env = {k: str(v) for k, v in stack.compose["services"][service]["environment"].items()}
    for key in ("DDILOCO_LEDGER__URL", "DDILOCO_LEDGER_URL"):
        if key in env:
            env[key] = stack.url(env[key])
    if "DDILOCO_STORAGE__STORAGE_OPTIONS" in env:
        env["DDILOCO_STORAGE__STORAGE_OPTIONS"] = env["DDILOCO_STORAGE__STORAGE_OPTIONS"].replace("http://s3:9000", s3_endpoint)
    if "PREFECT_API_URL" in env:
        env["PREFECT_API_URL"] = stack.server.api_url
    return env


def test_compose_services_come_up_on_one_postgres_in_their_own_databases(stack, s3_endpoint, tmp_path):
    import s3fs

    s3fs.S3FileSystem(skip_instance_cache=True).mkdir("ddiloco-runs")
    worker_env = compose_env(stack, "worker-us", s3_endpoint)
    upgrade = subprocess.run([sys.executable, "-m", *service_command(stack.compose, "ledger-upgrade")],
                             env={**stack.server.env, **worker_env}, capture_output=True, text=True, timeout=120)
    assert upgrade.returncode == 0, upgrade.stderr
    versions = {}
    for name, database in stack.databases.items():
        engine = create_engine(make_url(stack.postgres).set(database=database))
        with engine.connect() as conn:
            versions[name] = conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one()
        assert "events" in inspect(engine).get_table_names(), f"{name} has no events table"
        engine.dispose()
    assert versions["prefect"] != versions["ddiloco"]  # two Alembic histories, one server, no clash

    cfg = tiny_config(name="compose", token_budget=10**9, learners={"regions": [{"name": "us", "learners": 1}], "heartbeat_s": 0.5,
                                                                     "poll_s": 0.2})
    config = write_config(cfg, tmp_path / "config.yaml")
    ui_port = free_port()
    ui = service_command(stack.compose, "dashboard")
    ui[ui.index("--port") + 1] = str(ui_port)
    logs = tmp_path / "logs"
    logs.mkdir()
    procs = [
        stack.server.spawn([sys.executable, "-m", "ddiloco", "synchronizer", "-c", str(config), "--label", "sync-a"], logs / "sync.log",
                           env=worker_env),
        stack.server.spawn([sys.executable, "-m", "ddiloco", "learner", "-c", str(config), "--learner", "us-0"], logs / "us-0.log",
                           env=worker_env),
        stack.server.spawn([sys.executable, "-m", *ui], logs / "ui.log", env=compose_env(stack, "dashboard", s3_endpoint)),
    ]
    try:
        wait_for(lambda: healthy(f"http://127.0.0.1:{ui_port}/_stcore/health"), 60, "the dashboard on its published port")
        sessions = session_factory(open_ledger(stack.url(stack.compose["services"]["worker-us"]["environment"]["DDILOCO_LEDGER__URL"])))

        def trained_and_merged():
            with sessions.begin() as s:
                acct = reports_q.token_accounting(s, "compose") if runs_q.get_run(s, "compose") else None
            return acct if acct is not None and acct.merged > 0 else None

        wait_for(trained_and_merged, 180, "the learner's updates merged in the compose ledger")
    finally:
        stop_processes(procs)
    for log in logs.iterdir():
        assert not [v for v in ("change-me-postgres", "change-me-s3-secret") if v in log.read_text()], f"{log.name} shows a credential"


def test_region_pools_from_the_templates_are_accepted_by_the_server(stack):
    from prefect.client.orchestration import get_client

    from ddiloco.flows.deploy import ensure_pool, read_job_template

    for path in sorted((INFRA / "work-pools").glob("*.json")):
        template = read_job_template(path)
        assert ensure_pool(f"tpl-{path.stem}", path.stem, template)
        with get_client(sync_client=True) as client:
            pool = client.read_work_pool(f"tpl-{path.stem}")
        assert pool.type == path.stem and pool.base_job_template == template
    broken = read_job_template(INFRA / "work-pools" / "kubernetes.json")
    del broken["variables"]["properties"]["gpus"]  # job_configuration still says {{ gpus }}
    with pytest.raises(Exception, match="gpus"):
        ensure_pool("tpl-broken", "kubernetes", broken)


REGIONS = ("us", "eu", "asia")
"""examples/multi-region.yaml's regions, which the README's commands make pools for."""


def delete_region_pools() -> None:
    """No ``region-*`` pools of the README's regions, as on a fresh server."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        for region in REGIONS:
            try:
                client.delete_work_pool(f"region-{region}")
            except ObjectNotFound:
                pass


def test_the_readmes_kubernetes_commands_make_the_region_pools_from_the_template(stack, tmp_path, monkeypatch):
    """The README's cloud-pool commands as typed: ``prefect work-pool create region-us --type kubernetes
    --base-job-template …`` through Prefect's CLI, then ``DDILOCO_DEPLOY__GPU_IMAGE=… ddiloco deploy -c
    examples/gpu-cluster.yaml --pool-type kubernetes …``, which makes the other regions' pools from the same template
    (pools need no cluster; only their workers do) and deployments whose job variables the server accepts against it."""
    from prefect.client.orchestration import get_client

    from ddiloco.flows.deploy import read_job_template

    create = readme_command("prefect", "work-pool", "create")
    deploy_k8s = readme_command("ddiloco", "deploy", "-c", "examples/gpu-cluster.yaml", "--pool-type")
    template = read_job_template(INFRA / "work-pools" / "kubernetes.json")
    delete_region_pools()
    try:
        proc = stack.server.spawn([sys.executable, "-m", *create.argv], tmp_path / "work-pool-create.log", cwd=ROOT)
        assert proc.wait(timeout=120) == 0, (tmp_path / "work-pool-create.log").read_text()[-2000:]
        monkeypatch.chdir(ROOT)  # the README's paths are relative to a checkout
        out = CliRunner().invoke(app, deploy_k8s.argv[1:], env=deploy_k8s.env)
        assert out.exit_code == 0, out.output
        with get_client(sync_client=True) as client:
            pools = {p.name: p for p in client.read_work_pools()}
            asia = client.read_deployment_by_name("ddiloco-learner/learner-asia")
            sync = client.read_deployment_by_name("ddiloco-synchronizer/synchronizer")
        for region in REGIONS:
            assert pools[f"region-{region}"].type == "kubernetes", region
            assert pools[f"region-{region}"].base_job_template == template, region
        assert asia.work_pool_name == "region-asia"
        assert (asia.job_variables["gpus"], asia.job_variables["image"]) == (8, deploy_k8s.env["DDILOCO_DEPLOY__GPU_IMAGE"])
        assert asia.job_variables["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        assert (sync.work_pool_name, sync.work_queue_name, sync.job_variables["gpus"]) == ("region-us", "control", 0)
        assert sync.job_variables["image"] == deploy_k8s.env["DDILOCO_DEPLOY__CPU_IMAGE"]
    finally:
        delete_region_pools()  # the module's other tests deploy these regions on process pools


@pytest.fixture(scope="module")
def ops(stack) -> Iterator[Webhook]:
    """The notification block the README's deploy names, ``custom-webhook/ops``, posting to a local webhook."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    hook = Webhook()
    CustomWebhookNotificationBlock(name="ops", url=hook.url, allow_private_urls=True,
                                   json_data={"subject": "{{subject}}", "body": "{{body}}"}).save("ops", overwrite=True)
    yield hook
    hook.close()


def deployment_text(d: DeploymentResponse) -> str:
    """What a deployment stores that a worker hands to its flow runs."""
    return json.dumps({"job_variables": d.job_variables, "parameters": d.parameters, "pull_steps": d.pull_steps})


def deployments_by_name() -> dict[str, DeploymentResponse]:
    """The server's deployments by ``flow/deployment`` name, as ``prefect deployment run`` names them."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return {f"{client.read_flow(d.flow_id).name}/{d.name}": d for d in client.read_deployments()}


def test_the_readmes_three_region_deploy_in_the_worker_environment(stack, ops, s3_endpoint, monkeypatch):
    """``docker compose … exec worker-us ddiloco deploy -c examples/multi-region.yaml --cron … --notify-block
    custom-webhook/ops`` as typed, in worker-us's environment (its credentials): a process pool per region, the
    deployments, the nightly schedule and the three alerts; no credential in a deployment or the output. In this
    process (the ``ddiloco`` command's own app): a fresh one would spend 10-30 s importing on 2 busy cores."""
    from prefect.client.orchestration import get_client

    from ddiloco.flows import alerts

    cmd = readme_command("ddiloco", "deploy", "-c", "examples/multi-region.yaml", "--cron")
    assert cmd.service == "worker-us"
    credentials = [v for k, v in dotenv(INFRA / ".env.example").items() if k.endswith(("PASSWORD", "SECRET_KEY"))]
    env = compose_env(stack, cmd.service, s3_endpoint)
    assert all(any(c in v for v in env.values()) for c in credentials)  # the worker holds them: they must not spread
    delete_region_pools()
    monkeypatch.chdir(ROOT)  # the README's paths are relative to a checkout, as in the image's /app
    result = CliRunner().invoke(app, cmd.argv[1:], env=env)
    output = result.output
    assert result.exit_code == 0, output
    assert "work pools: region-us, region-eu, region-asia" in output and "-> custom-webhook/ops" in output, output
    deployments = deployments_by_name()
    with get_client(sync_client=True) as client:
        pools = {p.name: p.type for p in client.read_work_pools()}
        automations = {a.name: a for a in client.read_automations() if a.name.startswith(alerts.PREFIX)}
        block = client.read_block_document_by_name(name="ops", block_type_slug="custom-webhook")
    assert {pools[f"region-{r}"] for r in REGIONS} == {"process"}
    assert {f"ddiloco-learner/learner-{r}" for r in REGIONS} <= set(deployments)
    nightly = deployments["ddiloco-training-run/training-run"]
    assert [s.schedule.cron for s in nightly.schedules] == ["0 2 * * *"]
    assert nightly.parameters["config"]["name"] == "multi-region" and nightly.work_pool_name == "region-us"
    assert len(automations) == 3
    assert {a.actions[0].block_document_id for a in automations.values()} == {block.id}
    for name, d in deployments.items():
        assert not [c for c in credentials if c in deployment_text(d)], f"deployment {name} holds a credential"
    assert not [c for c in credentials if c in output]


def test_deployments_carry_secret_names_and_the_alerts_fire(stack, ops, tmp_path, monkeypatch):
    """Deployments name Secret blocks, never values; each of the three automations fires into the notification block
    on the events or state that trigger it for real (the supervisor's events through ``alerts.emit``, a flow run Crashed)."""
    from prefect.blocks.system import Secret
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    from ddiloco.flows import alerts
    from ddiloco.flows.deploy import deploy
    from ddiloco.flows.training import training_run

    ledger_url = f"postgresql+psycopg://ddiloco:{PASSWORD}@db.internal:5432/ddiloco"
    Secret(value=ledger_url).save("ddiloco-ledger-url", overwrite=True)
    cfg = tiny_config(name="alerts", ledger={"url": ledger_url}, storage={"url": "s3://ddiloco-runs/run", "secrets": {"secret": PASSWORD}})
    plan = deploy(cfg, secret_blocks={"DDILOCO_LEDGER__URL": "ddiloco-ledger-url"}, notify_block="custom-webhook/ops",
                  alert_policy=alerts.AlertPolicy(stall_minutes=30, relaunches_per_hour=1))
    assert len(plan.automations) == 3
    deployments = deployments_by_name()
    with get_client(sync_client=True) as client:
        automations = {a.name: a for a in client.read_automations()}
    assert len(plan.deployments) >= 3 and set(plan.deployments) <= set(deployments)
    for name, d in deployments.items():
        assert PASSWORD not in deployment_text(d), f"deployment {name} holds the password"
    for d in (deployments[name] for name in plan.deployments):
        assert d.job_variables["env"]["DDILOCO_LEDGER__URL"] == "{{ prefect.blocks.secret.ddiloco-ledger-url }}"
        assert d.job_variables["env"]["PREFECT_LOGGING_EXTRA_LOGGERS"] == "ddiloco"
    assert set(plan.automations) <= set(automations)
    # Again through the CLI, the password in its environment: the automations are updated in place, not doubled,
    # with a stall window of 12 s so that alert can fire within the test (Prefect's shortest proactive window is 10 s).
    monkeypatch.setenv("DDILOCO_LEDGER__URL", ledger_url)
    out = CliRunner().invoke(app, ["deploy", "-c", str(write_config(cfg, tmp_path / "alerts.yaml")), "--cron", "0 2 * * *",
                                   "--secret-block", "DDILOCO_LEDGER__URL=ddiloco-ledger-url", "--notify-block", "custom-webhook/ops",
                                   "--stall-minutes", "0.2", "--relaunches-per-hour", "1"])
    assert out.exit_code == 0, out.output
    assert "alerts: ddiloco: no new global version" in out.output and PASSWORD not in out.output
    with get_client(sync_client=True) as client:
        assert len([a for a in client.read_automations() if a.name.startswith(alerts.PREFIX)]) == 3
    assert not [name for name, d in deployments_by_name().items() if PASSWORD in deployment_text(d)]

    # No new version: a run that published once and then nothing fires; a run that finished does not.
    stalled, finished = (alerts.RUN_RESOURCE.format(run_id=r) for r in ("alerts-stalled", "alerts-finished"))
    for event, run in (("ddiloco.run.started", finished), ("ddiloco.run.finished", finished),
                       ("ddiloco.run.started", stalled), ("ddiloco.version.published", stalled)):
        alerts.emit(event, run)
    # Relaunched repeatedly: one more relaunch of a learner within the hour than the policy allows.
    learner = alerts.LEARNER_RESOURCE.format(run_id="alerts", learner_id="eu-0")
    for _ in range(2):
        alerts.emit("ddiloco.learner.relaunched", learner, **{"ddiloco.run": "alerts"})
    # Crashed: the state a worker reports when a flow run's process dies, here set through the API.
    with get_client(sync_client=True) as client:
        crashed = client.create_flow_run(training_run, name="alerts-crashed-run")
        client.set_flow_run_state(crashed.id, Crashed(message="process exited with SIGKILL"), force=True)

    got = wait_for(lambda: ops.posts(subject="relaunched repeatedly", body=learner), 90, "the relaunch alert's notification")
    assert len(got) == 1
    wait_for(lambda: ops.posts(subject="flow run crashed", body="alerts-crashed-run"), 90, "the crash alert's notification")
    wait_for(lambda: ops.posts(subject="no new global version", body=stalled), 90, "the stall alert's notification")
    assert not ops.posts(subject="no new global version", body=finished)  # its window closed no later than the stalled one's


# Each wait below has its own bound (learners registered 240 s, relaunch 240 s, the run's end 300 s); the suite-wide 300 s
# guard is less than their sum. Seven flow-run processes start here, each importing Prefect and torch: 72 s alone and
# 82 s in a full suite on a 2-core machine whose suite took 8:54, but more than 300 s in CI's run whose suite took 21:32.
@pytest.mark.timeout(900)
def test_training_run_from_the_readmes_deployment_run_on_two_region_pools(stack, ops, tmp_path):
    """``prefect deployment run ddiloco-training-run/training-run`` as the README types it, through Prefect's CLI; a
    worker per region pool runs the learners; a learner SIGKILLed is relaunched, and its crash and relaunch reach the
    alerts' notification block from the real worker and supervisor."""
    from prefect.blocks.system import Secret
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentUpdate
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from ddiloco.flows import alerts
    from ddiloco.flows.deploy import deploy

    cfg = tiny_config(
        name="pools",
        # Steps of tens of milliseconds: a tinier model outruns a synchronizer on 2 busy cores.
        model={"kind": "gpt", "n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 64},
        token_budget=10**9,  # the run is time-boxed below, so the killed learner's relaunch is inside it
        # Paced to a quarter of their speed: what is under test is the deployments, workers and alerts, and learners
        # training flat out for the whole time box took CPU from the Prefect server and the rest of the suite.
        learners={"regions": [{"name": "us", "learners": 1, "speeds": [0.25]}, {"name": "eu", "learners": 1, "speeds": [0.25]}],
                  "heartbeat_s": 0.5, "batch_size": 16,
                  "poll_s": 0.2, "dead_after_s": 5.0, "startup_grace_s": 90.0},
        synchronizer={"poll_s": 0.1, "lease_ttl_s": 2.0, "eval_every_s": 5.0},
        ledger={"url": f"sqlite:///{tmp_path / 'ledger.db'}"},
        storage={"url": f"file://{tmp_path / 'store'}"},
    )
    # The ledger URL is a secret: the deployments name its block, the workers read it when they start a flow run.
    Secret(value=cfg.ledger.url.get_secret_value()).save("pools-ledger-url", overwrite=True)
    # Alert on any relaunch: the one this test causes must reach the webhook.
    plan = deploy(cfg, secret_blocks={"DDILOCO_LEDGER__URL": "pools-ledger-url"}, notify_block="custom-webhook/ops",
                  alert_policy=alerts.AlertPolicy(relaunches_per_hour=0))
    assert plan.pools == ["region-us", "region-eu"]
    # Workers that ask for new flow runs every second, not every 10 s (Prefect's default): the run starts its
    # learners in two waves (the flow, then its learners and synchronizers) and the relaunch is a third.
    workers = [stack.server.spawn([sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process"],
                                  tmp_path / f"worker-{pool}.log", cwd=tmp_path, env={"PREFECT_WORKER_QUERY_SECONDS": "1"})
               for pool in plan.pools]
    run_command = readme_command("prefect", "deployment", "run")
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(run_command.argv[-1])
        assert deployment.parameters == {"config": cfg.model_dump(mode="json", exclude={"ledger", "storage"}), "launcher": "work-pools"}
        # A default a user can set in the UI: the run is time-boxed, so the killed learner's relaunch is inside it.
        client.update_deployment(deployment.id, DeploymentUpdate(parameters={**deployment.parameters, "seconds": 30.0}))
    triggered = time.time()
    cli = subprocess.run([sys.executable, "-m", *run_command.argv], env=stack.server.env, cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", cli.stdout).group(1)
    engine = open_ledger(cfg.ledger.url)
    # Read-only snapshots: a write transaction's BEGIN IMMEDIATE from a starved test process holds SQLite's one write
    # lock against the run's own synchronizer and learners.
    sessions = session_factory(reader_of(engine))

    def learner_rows():
        with sessions.begin() as s:
            if runs_q.get_run(s, "pools") is None:
                return None
            rows = runs_q.learners(s, "pools")
        return rows if len(rows) == 2 and all(r.pid for r in rows) else None

    rows = wait_for(learner_rows, 240, "both learners to register")
    first_heartbeat_s = time.time() - triggered
    assert {r.region for r in rows} == {"us", "eu"}
    victim = next(r for r in rows if r.region == "eu")
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.time()

    def relaunched():
        with sessions.begin() as s:
            row = {r.id: r for r in runs_q.learners(s, "pools")}[victim.id]
        return row.incarnation >= 1

    wait_for(relaunched, 240, "the supervisor to relaunch the killed learner")
    relaunch_s = time.time() - killed

    def finished():
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(flow_run_id).state
        return state if state and state.is_final() else None

    state = wait_for(finished, 300, "the training run to finish")
    assert state.is_completed(), state
    with sessions.begin() as s:
        run = runs_q.get_run(s, "pools")
        kinds = {e.kind for e in runs_q.events(s, "pools", limit=100_000)}
        acct = reports_q.token_accounting(s, "pools")
    assert run.status == "finished"
    assert "learner_relaunched" in kinds
    # The worker reported the killed learner's flow run Crashed and the supervisor relaunched it: both alerts fired.
    wait_for(lambda: ops.posts(subject="flow run crashed", body=f"pools-{victim.id}"), 60, "the crash alert for the killed learner")
    relaunched_learner = alerts.LEARNER_RESOURCE.format(run_id="pools", learner_id=victim.id)
    wait_for(lambda: ops.posts(subject="relaunched repeatedly", body=relaunched_learner), 60, "the relaunch alert for the killed learner")
    with get_client(sync_client=True) as client:
        learner_runs = [r.id for r in client.read_flow_runs() if r.name.startswith("pools-us-")]
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=learner_runs)))
    # PREFECT_LOGGING_EXTRA_LOGGERS=ddiloco (the deployments' env): the learner's own log lines reach the Prefect UI.
    assert [entry for entry in logs if entry.name.startswith("ddiloco.") and "joined run pools" in entry.message]
    # The supervisor's events, which the alerts' automations watch, reached the server.
    def stored(name: str) -> bool:  # the server persists events in batches: poll
        query = {"filter": {"event": {"name": [name]}}, "limit": 1}
        return bool(httpx.post(f"{stack.server.api_url}/events/filter", json=query).json()["events"])

    for name in ("ddiloco.run.started", "ddiloco.version.published", "ddiloco.learner.relaunched", "ddiloco.run.finished"):
        wait_for(lambda name=name: stored(name), 30, f"the {name} event on the server")
    assert acct.trained > 0 and acct.merged > 0 and acct.balanced
    stop_processes(workers)
    print(f"trigger -> learners registered: {first_heartbeat_s:.1f}s; kill -> relaunched learner rejoined: {relaunch_s:.1f}s")
    (Path(tmp_path) / "figures.txt").write_text(f"{first_heartbeat_s:.1f} {relaunch_s:.1f}\n")
