"""Commands that do what they say: read commands never write a ledger, bad arguments are refused before any
work starts, an unreachable ledger is reported within seconds, scratch runs never take production URLs."""

from __future__ import annotations

import errno
import os
import sqlite3
import subprocess
import sys
import time
from datetime import datetime, timezone

import pytest
import typer
from alembic.migration import MigrationContext
from typer.testing import CliRunner

from ddiloco.admin import OperatorErrors, operator_error
from ddiloco.cli import ENV_STORAGE, _scratch_storage_only, app
from ddiloco.platform.ledger import make_engine, session_factory, upgrade
from ddiloco.platform.ledger import runs as runs_q
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


# --- an operator's mistake ends in one line, in every command (#29) ----------------------------------------------

SECRET = "hunter2-planted"


def assert_refused(code: int, stderr: str, needle: str, stdout: str = "") -> None:
    """Exit 2 and one ``error:`` line naming the problem (a config error's fields follow it, indented); no traceback,
    no secret."""
    assert code == 2, stderr + stdout
    assert "Traceback" not in stderr + stdout and SECRET not in stderr + stdout, stderr + stdout
    lines = stderr.rstrip("\n").splitlines()
    at = [i for i, line in enumerate(lines) if line.startswith("error:")]
    assert len(at) == 1, stderr
    assert all(line.startswith("  ") for line in lines[at[0] + 1:]), stderr
    assert needle in "\n".join(lines[at[0]:]), stderr


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A folder holding a regular file, a directory and a SQLite ledger with run 'r' (nothing published)."""
    root = tmp_path_factory.mktemp("site")
    (root / "afile").write_text("not a folder")
    (root / "adir").mkdir()
    engine = make_engine(f"sqlite:///{root}/ledger.db")
    upgrade(engine)
    with session_factory(engine).begin() as s:
        runs_q.create_run(s, "r", config_json="{}", code_version="test", git_commit=None, num_fragments=2, token_budget=10,
                          now=datetime.now(timezone.utc))
    engine.dispose()
    return root


L = "sqlite:///{W}/ledger.db"
MISTAKES = [
    # an unknown run id
    ("unknown-run", ["summary", "--run", "nosuch", "--ledger", L], "run 'nosuch' is not in the ledger"),
    ("unknown-learner", ["learner", "--learner", "zz-9"], "learner 'zz-9' is not in learners.regions"),
    # unsupported or malformed ledger URLs, an unreachable ledger
    ("runs-not-a-url", ["runs", "--ledger", "garbage"], "not a ledger URL: garbage"),
    ("runs-backend", ["runs", "--ledger", "mysql://ops:{S}@db/x"], "unsupported ledger backend 'mysql'"),
    ("upgrade-not-a-url", ["ledger", "upgrade", "--ledger", "garbage"], "not a database URL"),
    ("upgrade-backend", ["ledger", "upgrade", "--ledger", "bogus://ops:{S}@db/x"], "unsupported ledger backend 'bogus'"),
    ("upgrade-unreachable", ["ledger", "upgrade", "--ledger", "{DEAD}"], "cannot reach or read the ledger: "),
    # store URLs: an unknown protocol, a regular file
    ("store-protocol", ["store", "check", "bogus://ops:{S}@bucket/x"], "unknown store protocol 'bogus'"),
    ("store-file", ["store", "check", "{W}/afile"], "{W}/afile or a folder above it is a file, not a directory"),
    ("store-below-file", ["store", "check", "file://{W}/afile/sub"], "is a file, not a directory"),
    ("check-store-file", ["ledger", "check", "--run", "r", "--ledger", L, "--store", "{W}/afile"], "is a file, not a directory"),
    ("export-to-protocol", ["export", "--run", "r", "--ledger", L, "--to", "bogus://ops:{S}@bucket/x"], "Protocol not known: bogus"),
    ("init-from-protocol", ["synchronizer", "--init-from", "bogus://ops:{S}@bucket/m.safetensors"],
     "model.init_from: unknown store protocol 'bogus'"),
    # a directory where a file is expected, and the reverse
    ("config-dir", ["config", "-c", "{W}/adir"], "config file {W}/adir is a directory"),
    ("ledger-dir", ["ledger", "upgrade", "--ledger", "sqlite:///{W}/adir"], "the SQLite path {W}/adir is a directory"),
    ("ledger-below-file", ["ledger", "upgrade", "--ledger", "sqlite:///{W}/afile/l.db"], "below {W}/afile, which is a file"),
    ("simulate-json-dir", ["simulate", "--json", "{W}/adir", "--plot", "{W}/g.png", "--chips", "1000", "--learners", "1",
                           "--days", "0.01"], "is a directory: {W}/adir"),
    ("data-out-file", ["data", "prepare", "--out", "{W}/afile", "--input", "{W}/afile", "--train-tokenizer", "300"],
     "file exists: {W}/afile"),
    # numbers a pydantic model bounds
    ("simulate-days", ["simulate", "--days", "-1"], "days: Input should be greater than 0"),
]


@pytest.mark.parametrize("args, needle", [case[1:] for case in MISTAKES], ids=[case[0] for case in MISTAKES])
def test_an_operator_mistake_is_one_line_never_a_traceback(site, monkeypatch, args, needle):
    monkeypatch.chdir(site / "adir")  # the default config's ledger and store would go here
    fill = {"W": str(site), "S": SECRET, "DEAD": f"postgresql+psycopg://ops:{SECRET}@127.0.0.1:{free_port()}/ledger"}
    result = CliRunner().invoke(app, [a.format(**fill) for a in args])
    assert_refused(result.exit_code, result.stderr, needle.format(**fill), result.stdout)


BOUNDS = [
    (["learner", "--learner", "us-0", "--max-steps", "-1"], "--max-steps"),  # it used to wait forever
    (["learner", "--learner", "us-0", "--max-steps", "0"], "--max-steps"),
    (["evaluate", "--wait-s", "-1"], "--wait-s"),
    (["synchronizer", "--shard", "-1"], "--shard"),
    (["demo", "--seconds", "0"], "--seconds"),
    (["data", "prepare", "--out", "x", "--input", "stdlib", "--train-tokenizer", "300", "--max-bytes", "-1"], "--max-bytes"),
    (["ui", "--port", "70000"], "--port"),
]


@pytest.mark.parametrize("args, option", BOUNDS, ids=[" ".join(a[:1] + a[-2:]) for a, _ in BOUNDS])
def test_numeric_options_refuse_nonsense_before_any_work(tmp_path, monkeypatch, args, option):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and f"Invalid value for '{option}'" in result.output, result.output
    assert "Traceback" not in result.output and list(tmp_path.iterdir()) == []  # nothing created, nothing started


def test_an_unknown_run_is_one_line_on_each_ledger(ledger_url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert CliRunner().invoke(app, ["ledger", "upgrade", "--ledger", ledger_url]).exit_code == 0
    for command in (["summary"], ["ledger", "check"], ["export", "--to", str(tmp_path / "out")]):
        result = CliRunner().invoke(app, [*command, "--run", "nosuch", "--ledger", ledger_url])
        assert_refused(result.exit_code, result.stderr, "run 'nosuch' is not in the ledger", result.stdout)


def test_real_processes_refuse_missing_credentials_and_an_unreachable_ledger(tmp_path):
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    # No credentials anywhere botocore looks, and an endpoint that would refuse the connection if it got that far.
    no_credentials = {**base, "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
                      "AWS_EC2_METADATA_DISABLED": "true", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}
    dead = f"postgresql+psycopg://ops:{SECRET}@127.0.0.1:{free_port()}/ledger"
    for args, env, needle in [
        (["store", "check", "s3://bucket/root"], no_credentials, "error: no object-store credentials"),
        (["ledger", "upgrade", "--ledger", dead], base, "error: cannot reach or read the ledger: "),
    ]:
        done = subprocess.run([sys.executable, "-m", "ddiloco", *args], capture_output=True, text=True, timeout=60, env=env,
                              stdin=subprocess.DEVNULL, cwd=tmp_path)
        assert_refused(done.returncode, done.stderr, needle, done.stdout)


@pytest.mark.parametrize("err", [KeyError("k"), ValueError("bad"), RuntimeError("boom"), TypeError("t"),
                                 OSError(errno.EBADF, "Bad file descriptor")], ids=lambda e: type(e).__name__)
def test_a_bug_is_not_taken_for_an_operator_mistake(err):
    assert operator_error(err) is None


def test_a_bug_keeps_its_traceback_with_credentials_masked():
    bugs = typer.Typer(cls=OperatorErrors)

    @bugs.command()
    def crash() -> None:
        raise RuntimeError(f"bug while talking to postgresql+psycopg://ops:{SECRET}@db/ledger")

    @bugs.command()
    def leave() -> None:
        raise typer.Exit(3)

    result = CliRunner().invoke(bugs, ["crash"])
    assert result.exit_code == 1 and "Traceback" in result.stderr and "RuntimeError: bug while talking" in result.stderr
    assert "postgresql+psycopg://ops:***@db/ledger" in result.stderr and SECRET not in result.output
    assert CliRunner().invoke(bugs, ["leave"]).exit_code == 3  # the framework's own exits pass through
