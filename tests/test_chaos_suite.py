"""``ddiloco chaos-suite --quick`` on the real multi-region backends: PostgreSQL (a server of the suite's own, restarted
mid-run: the rest of the test suite's PostgreSQL tests never see the restart),
moto's S3 server (stopped and restarted on its port), learners and synchronizers as OS processes
stopped at named fault points and SIGKILLed. The suite runs once (as a user would run it, through
the CLI); each fault of the matrix is then its own test, and the invariants are checked after
every fault by the suite itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.timeout(900)]

MATRIX = [
    "learner SIGKILL mid-step",
    "learner SIGKILL mid-upload",
    "learner SIGKILL mid-download",
    "learner SIGSTOP past heartbeat timeout, then SIGCONT",
    "synchronizer SIGKILL mid-merge",
    "synchronizer SIGKILL between blob write and commit",
    "synchronizer SIGKILL during lease renewal",
    "PostgreSQL restarted mid-run",
    "object store down",
    "bad submissions",
    "hostile learner (lying counts, outsized updates)",
    "bad configs and CLI input",
    "planted credentials in the ledger or logs",
]


@pytest.fixture(scope="module")
def suite(tmp_path_factory, postgres_url) -> tuple[subprocess.CompletedProcess, dict, Path]:
    tmp = tmp_path_factory.mktemp("chaos")
    out = tmp / "chaos.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "DDILOCO_FAULT"))}
    shared_started = postmaster_started(postgres_url)
    proc = subprocess.run(
        [sys.executable, "-m", "ddiloco", "chaos-suite", "--quick", "--json", str(out), "--workdir", str(tmp / "work")],
        capture_output=True, text=True, timeout=840, env=env,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    # The server the rest of this test suite shares was never restarted (the fault restarted the suite's own).
    assert postmaster_started(postgres_url) == shared_started
    return proc, json.loads(out.read_text()), tmp / "work"


def postmaster_started(url: str) -> object:
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return conn.scalar(text("SELECT pg_postmaster_start_time()"))
    finally:
        engine.dispose()


def row(report: dict, name: str) -> dict:
    rows = [f for f in report["faults"] if f["fault"] == name]
    assert len(rows) == 1, [f["fault"] for f in report["faults"]]
    return rows[0]


@pytest.mark.parametrize("fault", MATRIX)
def test_fault_is_injected_survived_and_loses_nothing(suite, fault):
    _, report, _ = suite
    f = row(report, fault)
    assert f["injected"] >= 1, f
    assert f["survived"] == f["injected"], f
    assert f["lost"] == 0, f
    assert f["recover_s"] is not None and f["recover_s"] >= 0


def test_invariants_hold_after_every_fault_and_the_run_never_stalled(suite):
    proc, report, _ = suite
    assert report["invariants_ok"], report["problems"]
    assert report["problems"] == []
    assert 0 < report["max_version_gap_s"] <= 12.0
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_the_processes_really_stopped_where_the_suite_says(suite):
    """Each fault point was reached by a real process (its marker), and that process was killed."""
    _, _, work = suite
    reached = {p.name for p in (work / "faults").rglob("*") if p.is_file() and p.parent.name != "arm"}
    assert {"learner.mid_step", "learner.after_blob", "learner.after_download",
            "sync.mid_merge", "sync.before_commit", "sync.renew_lease"} <= reached
    logs = "\n".join(p.read_text(errors="replace") for p in work.glob("sync-*.log"))
    assert "holds the lease" in logs


def test_json_report_has_the_documented_shape(suite):
    _, report, _ = suite
    assert {"faults", "invariants_ok"} <= set(report)
    for f in report["faults"]:
        assert {"fault", "injected", "survived", "lost", "recover_s"} <= set(f)
    assert [f["fault"] for f in report["faults"]][: len(MATRIX) - 3] == MATRIX[: len(MATRIX) - 3]
