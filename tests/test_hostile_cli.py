"""Commands that do what they say: read commands never write a ledger, bad arguments are refused before any
work starts, an unreachable ledger is reported within seconds, scratch runs never take production URLs."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time

import pytest
from alembic.migration import MigrationContext
from typer.testing import CliRunner

from ddiloco.cli import ENV_STORAGE, _scratch_storage_only, app
from ddiloco.platform.ledger import make_engine, upgrade
from ddiloco.testing.net import free_port

pytestmark = pytest.mark.timeout(60)


def invoke(*args: str):
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


def revision(url: str) -> str | None:
    engine = make_engine(url, read_only=True)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def test_runs_on_a_mistyped_sqlite_path_creates_nothing(tmp_path):
    target = tmp_path / "no" / "such" / "ledger.db"
    code, out = invoke("runs", "--ledger", f"sqlite:///{target}")
    assert code == 2 and "no ledger file" in out, out
    assert not (tmp_path / "no").exists()


READ_COMMANDS = [["runs"], ["summary", "--run", "r"], ["ledger", "check", "--run", "r"], ["export", "--run", "r", "--to", "out"],
                 ["run", "stop", "r"]]  # the last writes a run's end, and opens only a ledger that exists at the newest schema too


@pytest.mark.parametrize("command", READ_COMMANDS, ids=lambda c: c[0] if c[0] not in ("ledger", "run") else "-".join(c[:2]))
@pytest.mark.parametrize("content", [b"", b"x", b"just some notes\n" * 10])
def test_read_commands_never_overwrite_a_file_that_is_not_a_ledger(tmp_path, monkeypatch, command, content):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "notes.db"
    path.write_bytes(content)
    code, out = invoke(*command, "--ledger", f"sqlite:///{path}")
    assert code == 2 and "is not a ledger" in out, out
    assert path.read_bytes() == content


def test_runs_refuses_a_sqlite_database_without_a_ledger(tmp_path):
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE notes (t TEXT)")
    before = path.read_bytes()
    code, out = invoke("runs", "--ledger", f"sqlite:///{path}")
    assert code == 2 and "holds no ledger" in out, out
    assert path.read_bytes() == before


@pytest.mark.parametrize("command", READ_COMMANDS, ids=lambda c: c[0] if c[0] not in ("ledger", "run") else "-".join(c[:2]))
def test_read_commands_never_migrate_an_old_ledger(tmp_path, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path}/old.db"
    engine = make_engine(url)
    upgrade(engine, "0003")
    engine.dispose()
    code, out = invoke(*command, "--ledger", url)
    assert code == 2 and "schema revision 0003" in out and "ddiloco ledger upgrade" in out, out
    assert revision(url) == "0003"
    code, out = invoke("ledger", "upgrade", "--ledger", url)  # the one command that migrates
    assert code == 0 and revision(url) != "0003"
    code, out = invoke("runs", "--ledger", url)
    assert code == 0, out


@pytest.mark.parametrize(
    "args, needle",
    [
        (["learner", "--learner", "us-0", "--run", "[x](https://evil.example)"], "run '[x](https://evil.example)' is not a valid id"),
        (["learner", "--learner", "us-0", "--run", "../other"], "is not a valid id"),
        (["synchronizer", "--run", "a b"], "run 'a b' is not a valid id"),
        (["evaluate", "--run", "a b"], "run 'a b' is not a valid id"),
        (["synchronizer", "--label", "[URGENT](https://evil.example)"], "synchronizer label"),
        (["summary", "--run", "x/../y"], "is not a valid id"),
        (["run", "finish", "[x](https://evil.example)"], "run '[x](https://evil.example)' is not a valid id"),
    ],
)
def test_bad_ids_are_refused_at_once(args, needle):
    start = time.perf_counter()
    code, out = invoke(*args)
    assert code == 2 and needle in out, out
    assert time.perf_counter() - start < 15.0  # the old behaviour waited 5 minutes (learner) or ran the whole demo


def test_demo_refuses_a_summary_path_that_is_a_directory_before_it_starts(tmp_path):
    start = time.perf_counter()
    code, out = invoke("demo", "--summary-json", str(tmp_path))
    assert code == 2 and "is a directory" in out, out
    assert time.perf_counter() - start < 15.0  # the old behaviour waited 5 minutes (learner) or ran the whole demo
    code, out = invoke("chaos-suite", "--json", str(tmp_path))
    assert code == 2 and "is a directory" in out, out


def test_scratch_runs_drop_exported_ledger_and_store_urls(monkeypatch, capsys):
    for key in ENV_STORAGE:
        monkeypatch.setenv(key, "postgresql+psycopg://prod@db/ledger" if "LEDGER" in key else "s3://prod-bucket")
    _scratch_storage_only(True, "the demo")
    assert all(os.environ.get(key) for key in ENV_STORAGE)  # told to: kept
    _scratch_storage_only(False, "the demo")
    assert not any(key in os.environ for key in ENV_STORAGE)
    assert "ignores DDILOCO_LEDGER__URL" in capsys.readouterr().err


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 40) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddiloco", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)


def test_an_unreachable_ledger_is_reported_within_seconds_never_a_silent_hang(tmp_path):
    secret = "hunter2-planted"
    url = f"postgresql+psycopg://ops:{secret}@127.0.0.1:{free_port()}/ledger"
    start = time.perf_counter()
    done = cli("synchronizer", "--wait-s", "1", env={"DDILOCO_LEDGER__URL": url, "DDILOCO_STORAGE__URL": f"file://{tmp_path}/s"})
    took = time.perf_counter() - start
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert "waiting for the ledger at postgresql+psycopg://ops:***@127.0.0.1" in out and "cannot reach the ledger" in out, out
    assert secret not in out and "Traceback" not in out
    assert took < 15, took


def test_deploy_without_a_prefect_api_fails():
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: None}):
        code, out = invoke("deploy")
    assert code == 2 and "no Prefect API configured" in out, out


def test_config_shows_every_url_masked():
    done = cli("config", env={"DDILOCO_STORAGE__URL": "s3://AKIAEX:wJalrSECRET@bucket/x",
                              "DDILOCO_LEDGER__URL": "postgresql+psycopg://ops@db/ledger?password=hunter2"})
    # Neither can be reached from here: the check says so, on lines that mask the credentials like the config does.
    assert done.returncode == 2, done.stderr
    assert "wJalrSECRET" not in done.stdout + done.stderr and "hunter2" not in done.stdout + done.stderr
    assert "s3://AKIAEX:***@bucket/x" in done.stdout
    assert "error: ledger postgresql+psycopg://ops@db/ledger?password=***" in done.stderr, done.stderr
    assert "error: store s3://AKIAEX:***@bucket/x" in done.stderr, done.stderr


def test_an_error_quoting_rich_markup_is_printed_as_text(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text('model:\n  kwargs:\n    "[/x]": 1\n    "[/x]": 2\n')
    code, out = invoke("config", "-c", str(path))
    assert code == 2 and "key '[/x]' appears twice" in out, out
