"""The real thing: a Prefect server, two region work pools with a worker each, deployments, and a
training-run triggered through the API exactly as the UI's Run button does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import tiny_config, wait_for

from ddiloco.platform.ledger import open_ledger, session_factory
from ddiloco.platform.ledger import queries as q
from ddiloco.testing.prefect import prefect_server as prefect_server_at

pytestmark = pytest.mark.slow


@pytest.fixture()
def prefect_server(tmp_path):
    with prefect_server_at(tmp_path) as server:
        yield server.env, server.procs


def test_training_run_from_the_api_on_two_region_pools(prefect_server, tmp_path):
    env, procs = prefect_server
    from prefect.client.orchestration import get_client

    from ddiloco.flows.deploy import deploy

    cfg = tiny_config(
        name="pools",
        # Steps of tens of milliseconds: a tinier model outruns a synchronizer on 2 busy cores.
        model={"kind": "gpt", "n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 64},
        token_budget=10**9,  # the run is time-boxed below, so the killed learner's relaunch is inside it
        learners={"regions": [{"name": "us", "learners": 1}, {"name": "eu", "learners": 1}], "heartbeat_s": 0.5, "batch_size": 16,
                  "poll_s": 0.2, "dead_after_s": 5.0, "startup_grace_s": 90.0},
        synchronizer={"poll_s": 0.1, "lease_ttl_s": 2.0, "eval_every_s": 5.0},
        ledger={"url": f"sqlite:///{tmp_path / 'ledger.db'}"},
        storage={"url": f"file://{tmp_path / 'store'}"},
    )
    plan = deploy(cfg)
    assert plan.pools == ["region-us", "region-eu"]
    for pool in plan.pools:
        log = open(tmp_path / f"worker-{pool}.log", "wb")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process"],
            # The ledger URL is a secret: it stays with the worker, whose flow runs inherit it.
            env={**env, "DDILOCO_LEDGER__URL": cfg.ledger.url.get_secret_value()},
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path,
        ))
    parameters = {
        "config": cfg.model_dump(mode="json", exclude={"ledger", "storage"}),
        "launcher": "work-pools",
        "run_id": "pools",
        "seconds": 30.0,
    }
    triggered = time.time()
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("ddiloco-training-run/training-run")
        flow_run = client.create_flow_run_from_deployment(deployment.id, parameters=parameters)
    engine = open_ledger(cfg.ledger.url)
    sessions = session_factory(engine)

    def learner_rows():
        with sessions.begin() as s:
            if q.get_run(s, "pools") is None:
                return None
            rows = q.learners(s, "pools")
        return rows if len(rows) == 2 and all(r.pid for r in rows) else None

    rows = wait_for(learner_rows, 240, "both learners to register")
    first_heartbeat_s = time.time() - triggered
    assert {r.region for r in rows} == {"us", "eu"}
    victim = next(r for r in rows if r.region == "eu")
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.time()

    def relaunched():
        with sessions.begin() as s:
            row = {r.id: r for r in q.learners(s, "pools")}[victim.id]
        return row.incarnation >= 1

    wait_for(relaunched, 240, "the supervisor to relaunch the killed learner")
    relaunch_s = time.time() - killed

    def finished():
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(flow_run.id).state
        return state if state and state.is_final() else None

    state = wait_for(finished, 300, "the training run to finish")
    assert state.is_completed(), state
    with sessions.begin() as s:
        run = q.get_run(s, "pools")
        kinds = {e.kind for e in q.events(s, "pools", limit=100_000)}
        acct = q.token_accounting(s, "pools")
    assert run.status == "finished"
    assert "learner_relaunched" in kinds
    assert acct.trained > 0 and acct.merged > 0 and acct.balanced
    print(f"trigger -> learners registered: {first_heartbeat_s:.1f}s; kill -> relaunched learner rejoined: {relaunch_s:.1f}s")
    (Path(tmp_path) / "figures.txt").write_text(f"{first_heartbeat_s:.1f} {relaunch_s:.1f}\n")
