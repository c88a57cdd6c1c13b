"""Prefect flows: pure supervision decisions, and the training-run flow on a real (temporary) Prefect."""

from __future__ import annotations

import os

import pytest
from sqlalchemy import inspect
from support import tiny_config

from ddiloco.flows.chaos import seeded_schedule
from ddiloco.flows.runner import SUPERVISE_EVERY_S
from ddiloco.flows.supervise import LearnerView, relaunch_decisions
from ddiloco.platform.ledger import make_engine, open_ledger, session_factory
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.liveness import LivenessPolicy


@pytest.fixture(scope="module")
def prefect_harness(tmp_path_factory):
    # Imported here, not at collection: it loads Prefect's server (~3 s), which every xdist worker would pay for.
    from prefect.testing.utilities import prefect_test_harness

    home = tmp_path_factory.mktemp("prefect-home")
    old = os.environ.get("PREFECT_HOME")
    os.environ["PREFECT_HOME"] = str(home)
    with prefect_test_harness(server_startup_timeout=120):
        yield
    if old is None:
        os.environ.pop("PREFECT_HOME", None)
    else:
        os.environ["PREFECT_HOME"] = old


def test_relaunch_decisions_with_reasons():
    views = [
        LearnerView("ended", running=False, started_at=0.0, last_heartbeat=95.0),
        LearnerView("starting", running=True, started_at=90.0, last_heartbeat=None),
        LearnerView("stuck-start", running=True, started_at=0.0, last_heartbeat=None),
        LearnerView("silent", running=True, started_at=0.0, last_heartbeat=80.0),
        LearnerView("healthy", running=True, started_at=0.0, last_heartbeat=99.0),
    ]
    out = relaunch_decisions(100.0, views, liveness=LivenessPolicy(dead_after_s=10.0), startup_grace_s=60.0)
    assert out == {
        "ended": "its process or flow run ended",
        "stuck-start": "no heartbeat 60s after launch",
        "silent": "heartbeat stopped 20.0s ago",
    }


def test_alert_policy_takes_seconds_down_to_prefects_shortest_window():
    import uuid
    from datetime import timedelta

    from ddiloco.flows.alerts import MIN_STALL_MINUTES, AlertPolicy, automations

    stall, relaunch, _ = automations(uuid.uuid4(), AlertPolicy(stall_minutes=0.2, relaunches_per_hour=0))
    assert stall.trigger.within == timedelta(seconds=12) and relaunch.trigger.threshold == 1
    assert automations(uuid.uuid4(), AlertPolicy(MIN_STALL_MINUTES))[0].trigger.within == timedelta(seconds=10)
    for bad in (0.1, 0.0, float("nan"), 7 * 24 * 60 + 1):
        with pytest.raises(ValueError, match="--stall-minutes"):
            AlertPolicy(stall_minutes=bad)


def test_seeded_chaos_schedule_is_deterministic_and_within_the_run():
    cfg = tiny_config(chaos={"seed": 7, "random_events": 5})
    a, b = seeded_schedule(cfg, 100.0), seeded_schedule(cfg, 100.0)
    assert a == b and len(a) == 5
    assert all(10.0 <= e.at_s <= 80.0 for e in a)
    assert [e.at_s for e in a] == sorted(e.at_s for e in a)
    other = seeded_schedule(tiny_config(chaos={"seed": 8, "random_events": 5}), 100.0)
    assert other != a


def test_bad_parameters_fail_the_flow_run_naming_the_field_and_write_nothing(prefect_harness, tmp_path, monkeypatch):
    from prefect.exceptions import ParameterTypeError

    from ddiloco.flows.training import training_run

    ledger = tmp_path / "ledger.db"
    monkeypatch.setenv("DDILOCO_LEDGER__URL", f"sqlite:///{ledger}")
    with pytest.raises(ParameterTypeError, match=r"config\.quorum\.min_count"):
        training_run(config={"quorum": {"min_count": -1}}, run_id="bad")
    if ledger.exists():
        tables = inspect(make_engine(f"sqlite:///{ledger}")).get_table_names()
        assert "runs" not in tables


def test_training_run_supervises_relaunches_and_finishes(prefect_harness, tmp_path):
    from prefect.client.orchestration import get_client

    from ddiloco.flows.training import training_run

    cfg = tiny_config(
        name="flowrun",
        token_budget=2 * 300 * 4 * 32,
        learners={"regions": [{"name": "us", "learners": 1}, {"name": "eu", "learners": 1}], "heartbeat_s": 0.5,
                  "poll_s": 0.2, "dead_after_s": 5.0},
        synchronizer={"poll_s": 0.1, "lease_ttl_s": 1.5, "eval_every_s": 2.0},
        ledger={"url": f"sqlite:///{tmp_path / 'ledger.db'}"},
        storage={"url": f"file://{tmp_path / 'store'}"},
        # At the first trained token, which the supervisor sees within a tenth of a second: the kill and the relaunch
        # (in the same pass) come long before the budget, however fast this machine trains.
        chaos={"events": [{"at_s": 0.0, "action": "kill_learner", "target": "eu-0"}]},
    )
    summary = training_run(config=cfg, run_id="flowrun", launcher="local", workdir=str(tmp_path / "runs"))
    assert summary["tokens"] >= cfg.token_budget
    assert summary["accounting_balanced"] is True
    assert sum(summary["versions"].values()) > 0
    assert summary["val_loss_end"] < summary["val_loss_start"]
    engine = open_ledger(cfg.ledger.url)
    with session_factory(engine).begin() as s:
        run = runs_q.get_run(s, "flowrun")
        events = runs_q.events(s, "flowrun", limit=100_000)
    assert run.status == "finished" and run.flow_run_url
    kinds = {e.kind: e.detail for e in events}
    assert kinds["chaos"].startswith("SIGKILL learner eu-0")
    # The supervisor saw the process end and relaunched it (rejoining is covered in test_processes).
    assert kinds["learner_relaunched"] == "eu-0: its process or flow run ended"
    # It recorded each launch and the exit it saw, the timeline the summary accounts the learners' seconds by.
    exits = [(e.actor, e.detail) for e in events if e.kind == runs_q.LEARNER_EXITED]
    launches = sorted((e.at, e.actor) for e in events if e.kind == runs_q.LEARNER_LAUNCHED)
    assert [(actor, detail.split(" (pid")[0]) for actor, detail in exits] == [("eu-0", "SIGKILL learner eu-0")]  # at the kill
    assert sorted(a for _, a in launches) == ["eu-0", "eu-0", "us-0"]
    exited_at = next(e.at for e in events if e.kind == runs_q.LEARNER_EXITED)
    assert launches[0][0] < exited_at <= launches[-1][0] and launches[-1][1] == "eu-0"
    # In the pass that killed it, not at the next one a whole pass later.
    assert (launches[-1][0] - exited_at).total_seconds() < SUPERVISE_EVERY_S
    assert sum(summary["time_breakdown"].values()) == pytest.approx(summary["learner_s"])
    with get_client(sync_client=True) as client:
        keys = {a.key for a in client.read_artifacts()}
    assert "summary-flowrun" in keys and "loss-flowrun" in keys


def test_evaluate_flow_fn_records_an_evaluation(tmp_path):
    from ddiloco.flows.training import evaluate_flow
    from ddiloco.platform.runtime import RunContext
    from ddiloco.synchronizer.service import Synchronizer

    cfg = tiny_config(name="evalfn", ledger={"url": f"sqlite:///{tmp_path / 'l.db'}"}, storage={"url": f"file://{tmp_path / 's'}"})
    Synchronizer(RunContext.open(cfg), holder="s").poll_once()
    result = evaluate_flow.fn(cfg)
    assert 5.0 < result["val_loss"] < 6.0  # an untrained byte model: about ln(256)
    with session_factory(open_ledger(cfg.ledger.url)).begin() as s:
        assert [e.val_loss for e in runs_q.evaluations(s, "evalfn")] == [result["val_loss"]]


@pytest.mark.timeout(300)
def test_every_path_to_a_learner_refuses_a_bad_id_with_the_same_line_and_writes_nothing(prefect_harness, tmp_path):
    """The CLI, the Prefect learner flow and the launchers (warm and cold) all run ``entry.learner_main``."""
    from typer.testing import CliRunner

    from ddiloco.cli import app
    from ddiloco.entry import EntryError, ProcessSpec
    from ddiloco.flows.launchers import SubprocessLauncher
    from ddiloco.flows.training import learner_flow
    from ddiloco.testing.processes import write_config

    ledger = tmp_path / "ledger.db"
    cfg = tiny_config(name="r", ledger={"url": f"sqlite:///{ledger}"})
    path = write_config(cfg, tmp_path / "config.yaml")
    launcher = SubprocessLauncher(path, "r", tmp_path / "logs")
    for k, bad in enumerate(("../x", "us-9")):  # an unsafe id; a safe one the config does not list
        out = CliRunner().invoke(app, ["learner", "--config", str(path), "--learner", bad])
        line = out.output.strip()
        assert out.exit_code == 2 and line.startswith("error: ") and repr(bad) in line and "\n" not in line, out.output
        with pytest.raises(EntryError) as refused:
            learner_flow(config=cfg, learner_id=bad, run_id="r")
        assert f"error: {refused.value}" == line
        for warm in (True, False):
            handle = launcher.spawn(f"bad-{k}-{warm}", ProcessSpec.learner(bad), warm=warm)
            assert handle.process.wait(timeout=240) == 2
            assert line in (tmp_path / "logs" / f"bad-{k}-{warm}.log").read_text().splitlines()
    assert not ledger.exists()
