"""Each dashboard page under ``streamlit.testing.v1.AppTest``, against a ledger filled by a real short
in-process run: the numbers shown are the ledger's, and broken or empty ledgers get a message, never
a traceback. The dashboard's clock is set to the simulated run's own time, so verdicts are exact."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pandas as pd
import pytest
import streamlit as st
from sqlalchemy import func, select
from sqlalchemy.orm import Session
from streamlit import dataframe_util
from streamlit.testing.v1 import AppTest
from ui_support import RunLedger, build_run_ledger, copy_ledger

from ddiloco.platform import liveness
from ddiloco.platform.ledger import learner as learner_q
from ddiloco.platform.ledger import open_ledger, session_factory
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger import synchronizer as sync_q
from ddiloco.platform.ledger.models import Learner, Merge, Run, Submission
from ddiloco.platform.summary import run_summary
from ddiloco.ui import APP_PATH, LEDGER_URL_ENV, loaders, widgets
from ddiloco.ui import health as h

pytestmark = pytest.mark.timeout(120)
RUN_HEALTH = "views/run_health.py"


@pytest.fixture(scope="module")
def run_ledger(tmp_path_factory) -> RunLedger:
    return build_run_ledger(tmp_path_factory.getbasetemp() / "ui-run")


@pytest.fixture(autouse=True)
def fresh_caches():
    st.cache_data.clear()
    st.cache_resource.clear()
    yield
    st.cache_data.clear()
    st.cache_resource.clear()


def open_app(monkeypatch, url: str | None, now=None, run: str | None = None, page: str | None = None) -> AppTest:
    if url is None:
        monkeypatch.delenv(LEDGER_URL_ENV, raising=False)
    else:
        monkeypatch.setenv(LEDGER_URL_ENV, url)
    if now is not None:
        monkeypatch.setattr(loaders, "utcnow", lambda: now)
    at = AppTest.from_file(str(APP_PATH), default_timeout=60)
    if run is not None:
        at.query_params["run"] = run
    at.run()
    if page is not None:
        at.switch_page(page).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def texts(at: AppTest) -> str:
    """Every message, caption, markdown and title the page shows, as one string (as read: escapes resolved)."""
    parts = []
    for kind in ("title", "markdown", "caption", "error", "warning", "info", "success"):
        parts += [str(e.value) for e in getattr(at, kind)]
    return as_read("\n".join(parts))


def as_read(markdown: str) -> str:
    """Markdown source as a reader sees it: backslash escapes resolved, zero-width spaces dropped."""
    return re.sub(r"\\([!-/:-@\[-`{-~])", r"\1", markdown).replace(widgets.ZWSP, "")


def frame_with(at: AppTest, column: str) -> pd.DataFrame:
    return next(d.value for d in at.dataframe if column in d.value.columns)


def test_overview_shows_every_run_with_the_ledgers_numbers(monkeypatch, run_ledger):
    now = run_ledger.end + timedelta(seconds=1)
    at = open_app(monkeypatch, run_ledger.url, now)
    engine = open_ledger(run_ledger.url, migrate=False, read_only=True)
    with Session(engine) as s:
        expected = run_summary(s, run_ledger.run_id, now)
    engine.dispose()
    m = metrics(at)
    assert (m["Runs"], m["Running"], m["Degraded"], m["Down"]) == ("1", "1", "1", "0")
    card = texts(at)
    assert f"**{h.format_count(expected.tokens)}** tokens" in card
    assert f"**{sum(expected.versions.values()):,}** versions" in card
    assert f"**{expected.goodput:.0%}** goodput" in card
    assert "**3/4** learners up" in card and f"val loss **{expected.val_loss_end:.3f}**" in card
    table = frame_with(at, "health").set_index("run")
    row = table.loc[run_ledger.run_id]
    assert row["health"] == h.DEGRADED and row["status"] == "running"
    assert row["tokens"] == expected.tokens and row["versions"] == sum(expected.versions.values())
    assert row["goodput"] == pytest.approx(expected.goodput)
    assert row["val_loss"] == pytest.approx(expected.val_loss_end)
    assert row["downtime"] == liveness.format_duration(expected.longest_version_gap_s)
    assert "1 of 4 learners dead" in row["reason"]
    links = at.get("page_link")
    assert links and "run=" + run_ledger.run_id in str(links[0].proto)


def test_run_health_page_shows_the_ledgers_numbers(monkeypatch, run_ledger):
    now = run_ledger.end + timedelta(seconds=1)
    at = open_app(monkeypatch, run_ledger.url, now, run=run_ledger.run_id, page=RUN_HEALTH)
    engine = open_ledger(run_ledger.url, migrate=False, read_only=True)
    with Session(engine) as s:
        expected = run_summary(s, run_ledger.run_id, now)
        evals = runs_q.evaluations(s, run_ledger.run_id)
        learners = {x.id: x for x in s.scalars(select(Learner))}
        fates = {
            (lid, status): n
            for lid, status, n in s.execute(
                select(Submission.learner_id, Submission.status, func.count()).group_by(Submission.learner_id, Submission.status)
            )
        }
        merges = s.scalar(select(func.count()).select_from(Merge))
    engine.dispose()

    m = metrics(at)
    assert m["Tokens trained"] == f"{expected.tokens:,}"
    assert m["Global versions"] == f"{sum(expected.versions.values()):,}"
    assert m["Goodput"] == f"{expected.goodput:.1%}"
    assert m["Max downtime"] == liveness.format_duration(expected.longest_version_gap_s)
    assert m["Validation loss"] == f"{evals[-1].val_loss:.4f}"
    assert m["Learners up"] == "3/4"
    assert m["Sent"] == h.format_bytes(expected.bytes_sent)
    assert m["Data-parallel"] == h.format_bytes(expected.bytes_data_parallel)
    assert m["Fencing token"] == "1"
    shown = texts(at)
    assert f"Run {run_ledger.run_id}" in shown and "DEGRADED" in shown and "1 of 4 learners dead · 1 straggling" in shown
    assert "sync-inprocess holds the lease (token 1" in shown
    assert "No Prefect flow run recorded" in shown

    table = frame_with(at, "last_heartbeat").set_index("learner")
    assert sorted(table.index) == sorted(learners)
    for lid, lrow in learners.items():
        row = table.loc[lid]
        assert (row["region"], row["step"]) == (lrow.region, lrow.step)
        assert row["tokens_per_s"] == pytest.approx(lrow.tokens_per_s)
        assert row["merged"] == fates.get((lid, "merged"), 0)
        assert row["rejected"] == fates.get((lid, "rejected"), 0)
        assert row["pending"] == fates.get((lid, "pending"), 0)
        assert row["tokens_trained"] == lrow.tokens_trained + lrow.inc_tokens_trained
        assert row["last_heartbeat"] == widgets.ago(lrow.last_heartbeat_at, now)
    assert table.loc["eu-1", "status"] == liveness.DEAD and table.loc["eu-0", "status"] == liveness.STRAGGLING
    assert (table.loc[["us-0", "us-1"], "status"] == liveness.ALIVE).all()
    # Grouped by region, the worst first within a region.
    assert list(table.index) == ["eu-1", "eu-0", "us-0", "us-1"]
    regions = frame_with(at, "share_merged").set_index("region")
    assert regions.loc["eu", "dead"] == 1 and regions.loc["us", "learners"] == 2
    assert len(frame_with(at, "grace_waited_s")) == merges
    events = frame_with(at, "category")
    assert {"learner_dead", "learner_restarted", "lease_acquired"} <= set(events["kind"])
    # Status grid, region tokens, tokens/s per learner, version timeline, quorum, grace, staleness, bytes, both losses,
    # events.
    assert len(at.get("vega_lite_chart")) == 11


def test_run_health_with_rejections_chaos_and_a_prefect_flow_run(monkeypatch, run_ledger, tmp_path):
    ledger = copy_ledger(run_ledger, tmp_path)
    engine = open_ledger(ledger.url)
    flow_url = "http://prefect.internal:4200/runs/flow-run/1234"
    with session_factory(engine).begin() as s:
        s.get(Run, ledger.run_id).flow_run_url = flow_url
        runs_q.record_event(s, ledger.run_id, "chaos", "chaos-flow", "SIGKILL learner eu-1", ledger.end - timedelta(seconds=40))
        sub = learner_q.SubmissionIn("u1", 0, 0, 1, 128, 128, 128, "k/u1", "0" * 64, 10, "none")
        learner_q.register_submission(s, ledger.run_id, "ghost", 0, sub, ledger.end)
        # What a GPU learner's beats write (in-process learners count no FLOPs), and a CPU's: FLOP/s with no MFU.
        s.get(Learner, (ledger.run_id, "us-0")).model_flops_per_s, s.get(Learner, (ledger.run_id, "us-0")).mfu = 3.87e14, 0.3913
        s.get(Learner, (ledger.run_id, "us-1")).model_flops_per_s = 2.1e9
    engine.dispose()
    at = open_app(monkeypatch, ledger.url, ledger.end + timedelta(seconds=1), run=ledger.run_id, page=RUN_HEALTH)
    assert [b.proto.url for b in at.get("link_button")] == [flow_url]
    grid = next(d for d in at.dataframe if "last_heartbeat" in d.value.columns)
    shown = dataframe_util.convert_arrow_bytes_to_pandas_df(grid.proto.arrow_data.styler.display_values)
    shown.columns = grid.value.columns
    shown = shown.set_index("learner")
    assert (shown.loc["us-0", "model_flops_per_s"], shown.loc["us-0", "mfu"]) == ("387 TFLOP/s", "39.1%")
    assert shown.loc["us-1", "model_flops_per_s"] == "2.10 GFLOP/s"
    # What none reported stays null, which the table draws as an empty cell, never as a figure.
    values = grid.value.set_index("learner")
    assert values.loc["us-1", ["mfu"]].isna().all() and values.loc[["eu-0", "eu-1"], ["model_flops_per_s", "mfu"]].isna().all().all()
    events = frame_with(at, "category")
    assert {"chaos", "rejection", "failure"} <= set(events["category"])
    rejected = frame_with(at, "decided_at")
    assert list(rejected["reason"]) == ["unknown learner 'ghost'"]
    assert len(at.get("vega_lite_chart")) == 12  # + rejections by reason


def test_a_dead_synchronizer_is_shown_as_down_and_the_ledger_is_untouched(monkeypatch, run_ledger, tmp_path):
    ledger = copy_ledger(run_ledger, tmp_path)
    engine = open_ledger(ledger.url)
    with session_factory(engine).begin() as s:
        lease = sync_q.current_lease(s, ledger.run_id)
        # Its lease ran out 5 s before the end and no standby took over.
        lease.expires_at = ledger.end - timedelta(seconds=5)
    engine.dispose()
    before = hashlib.sha256(ledger.path.read_bytes()).hexdigest()
    now = ledger.end + timedelta(seconds=1)
    at = open_app(monkeypatch, ledger.url, now, run=ledger.run_id, page=RUN_HEALTH)
    shown = texts(at)
    assert "DOWN" in shown
    assert "no active synchronizer: the lease of sync-inprocess (token 1) expired 6.0s ago" in shown
    assert ":red-badge[NO ACTIVE SYNCHRONIZER]" in shown
    at = open_app(monkeypatch, ledger.url, now)
    assert frame_with(at, "health").iloc[0]["health"] == h.DOWN
    # Both pages read the ledger; neither changed a byte of it.
    st.cache_resource.clear()  # closes the pooled connections
    assert hashlib.sha256(ledger.path.read_bytes()).hexdigest() == before


def test_everything_silent_long_after_the_run(monkeypatch, run_ledger):
    at = open_app(monkeypatch, run_ledger.url, run_ledger.end + timedelta(minutes=10), run=run_ledger.run_id, page=RUN_HEALTH)
    shown = texts(at)
    assert "DOWN" in shown and "all 4 learners are dead" in shown and "no active synchronizer" in shown
    assert set(frame_with(at, "last_heartbeat")["status"]) == {liveness.DEAD}
    # us-0 and us-1 fell silent together: their region is shown cut off, with since when; eu's learners died apart.
    regions = frame_with(at, "share_merged").set_index("region")
    assert (regions.loc["us", "status"], regions.loc["eu", "status"]) == (liveness.CUT_OFF, liveness.REGION_DOWN)
    reason = regions.loc["us", "reason"]
    assert reason.startswith("all 2 learners silent since ") and reason.endswith(": cut off from the ledger?")
    assert f"Region **us** {reason}" in shown and "Region **eu**" not in shown


def test_a_finished_run_reads_as_finished_everywhere_and_no_tile_cuts_its_figure(monkeypatch, run_ledger, tmp_path):
    ledger = copy_ledger(run_ledger, tmp_path)
    engine = open_ledger(ledger.url)
    with session_factory(engine).begin() as s:
        trained = sum(r.tokens_trained + r.inc_tokens_trained for r in runs_q.learners(s, ledger.run_id))
        # The figure: as an exact number ('1,327,104') it is wider than its tile.
        us0 = s.get(Learner, (ledger.run_id, "us-0"))
        us0.tokens_trained += 1_327_104 - trained
        runs_q.set_run_status(s, ledger.run_id, runs_q.FINISHED, ledger.end, detail="token budget reached")
        created = runs_q.require_run(s, ledger.run_id).created_at
    engine.dispose()
    later = ledger.end + timedelta(hours=3)  # looked at long after the end: nothing is measured against this clock
    at = open_app(monkeypatch, ledger.url, later, run=ledger.run_id, page=RUN_HEALTH)
    m = metrics(at)
    assert m["Tokens trained"] == "1.33M"
    assert next(e.proto.help for e in at.metric if e.label == "Tokens trained").startswith("1,327,104 trained: ")
    assert "Learners up" not in m and "Since new version" not in m
    assert m["Finished at"] == f"{ledger.end:%H:%M}" and m["Ran for"] == liveness.format_duration((ledger.end - created).total_seconds())
    assert max(len(v) for v in m.values()) <= 7, m  # each fits its tile whole (Streamlit cuts a wider one off)
    shown = texts(at)
    assert "FINISHED" in shown and f"finished at {ledger.end:%Y-%m-%d %H:%M:%S} UTC, after " in shown
    assert ":gray-badge[RUN ENDED]" in shown and "sync-inprocess held the lease last (token 1)" in shown
    tables = [d.value for d in at.dataframe]
    cells = " ".join(str(v) for df in tables for v in df.astype(str).to_numpy().ravel())
    # Nothing reads as live: no 'ago', no lease to renew, no learner 'up' against a clock past the end.
    for live in (" ago", "renew due", "holds the lease", "learners up"):
        assert live not in shown and live not in cells and all(live not in v for v in m.values()), live
    learners = frame_with(at, "last_heartbeat")
    assert all(v.endswith(("before the end", "after the end")) for v in learners["last_heartbeat"]), list(learners["last_heartbeat"])
    assert frame_with(at, "role").iloc[-1]["role"] == "last holder"
    card = texts(open_app(monkeypatch, ledger.url, later))
    assert "**4** learners · finished" in card and "learners up" not in card


def test_empty_ledger_and_a_run_with_no_heartbeats(monkeypatch, tmp_path):
    url = f"sqlite:///{tmp_path}/ledger.db"
    engine = open_ledger(url)
    at = open_app(monkeypatch, url)
    assert "no runs yet" in texts(at)
    at = open_app(monkeypatch, url, page=RUN_HEALTH)
    assert "no runs yet" in texts(at)
    now = loaders.utcnow()
    with session_factory(engine).begin() as s:
        runs_q.create_run(s, "fresh", config_json="{}", code_version="t", git_commit=None, num_fragments=2, token_budget=100, now=now)
    engine.dispose()
    st.cache_data.clear()  # as if the cache's TTL had passed
    at = open_app(monkeypatch, url, page=RUN_HEALTH)
    shown = texts(at)
    assert "STARTING" in shown
    assert "No learner has joined this run yet" in shown
    assert "No global version published yet" in shown and "No evaluation recorded yet" in shown
    assert len(at.get("vega_lite_chart")) == 1  # only the events timeline (run_created)


@pytest.mark.parametrize(
    "case, expect",
    [
        ("no url", "No ledger chosen"),
        ("missing file", "no ledger file at"),
        ("no schema", "ddiloco ledger upgrade"),
        ("server down", "cannot connect to the ledger"),
    ],
)
def test_unusable_ledgers_get_a_message(monkeypatch, tmp_path, case, expect):
    url = {
        "no url": None,
        "missing file": f"sqlite:///{tmp_path}/missing/ledger.db",
        "no schema": f"sqlite:///{tmp_path}/empty.db",
        "server down": "postgresql+psycopg://ops:s3cret@127.0.0.1:9/ledger?connect_timeout=2",
    }[case]
    if case == "no schema":
        (tmp_path / "empty.db").touch()
    at = open_app(monkeypatch, url)
    assert expect in "\n".join(e.value for e in at.error)
    everything = texts(at) + "".join(str(e.proto) for e in at.sidebar)
    assert "s3cret" not in everything
    assert not (tmp_path / "missing").exists()


def test_ui_command_serves_the_app_with_the_ledger_in_the_environment(monkeypatch):
    import typer
    from typer.testing import CliRunner

    from ddiloco.ui import command

    calls = []
    monkeypatch.setattr(command, "serve", lambda cmd, env: calls.append((cmd, env)) or 0)
    app = typer.Typer()
    app.command("ui")(command.ui_command)
    result = CliRunner().invoke(app, ["--ledger", "postgresql+psycopg://ops:s3cret@db/ledger", "--port", "8600"])
    assert result.exit_code == 0, result.output
    assert "s3cret" not in result.output and "db/ledger" in result.output
    ((cmd, env),) = calls
    assert cmd[1:5] == ["-m", "streamlit", "run", str(APP_PATH)]
    assert cmd[cmd.index("--server.port") + 1] == "8600" and cmd[cmd.index("--server.address") + 1] == "127.0.0.1"
    assert not any("s3cret" in part for part in cmd)
    assert env[LEDGER_URL_ENV] == "postgresql+psycopg://ops:s3cret@db/ledger"
    bad = CliRunner().invoke(app, ["--ledger", "not a url"])
    assert bad.exit_code == 2
    assert Path(APP_PATH).is_file()


def test_the_dashboard_loads_without_torch():
    """The app and every module its pages import, in a fresh interpreter: torch (seconds to import,
    tens of seconds on a busy host) stays out, so a page's first render is not held up by it."""
    code = textwrap.dedent(
        f"""
        import ast, importlib, pathlib, sys
        import ddiloco.ui.app
        pages = sorted(pathlib.Path({str(Path(APP_PATH).parent / "views")!r}).glob("*.py"))
        for page in pages:
            for node in ast.walk(ast.parse(page.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                    importlib.import_module(node.module)
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        importlib.import_module(alias.name)
        print(len(pages), "torch" in sys.modules)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["2", "False"], out.stdout


def everything_shown(at: AppTest) -> str:
    """Every value, label and table cell of the page, as one string."""
    parts = [texts(at)]
    for kind in ("header", "subheader", "text", "code", "json", "exception"):
        parts += [str(e.value) for e in getattr(at, kind, [])]
    parts += [f"{m.label} {m.value} {m.delta}" for m in at.metric]
    parts += [d.value.to_csv() for d in at.dataframe]
    parts += [" ".join(map(str, s.options)) for s in at.selectbox]
    return "\n".join(parts)


@pytest.mark.postgres
def test_planted_credentials_reach_neither_the_ledger_nor_the_dashboard(monkeypatch, run_ledger, fresh_postgres_database):
    """The ledger's password (planted: the test server trusts local connections and ignores it)
    is in the URL every process and the dashboard open; it must not be recorded or shown."""
    from sqlalchemy.engine import make_url
    from support import tiny_config
    from ui_support import copy_ledger_to

    from ddiloco.platform.ledger.models import Base
    from ddiloco.platform.run_state import build_layout, register_run
    from ddiloco.platform.runtime import RunContext

    secret = f"planted-{hashlib.sha256(str(id(monkeypatch)).encode()).hexdigest()[:16]}"
    url = make_url(fresh_postgres_database).set(password=secret).render_as_string(hide_password=False)
    copy_ledger_to(run_ledger.url, url)
    cfg = tiny_config(name="creds", ledger={"url": url}, storage={"url": "memory://creds"})
    ctx = RunContext.open(cfg)
    register_run(ctx, build_layout(ctx))
    with Session(ctx.engine) as s:
        recorded = s.get(Run, "creds").config_json
        rows = [str(v) for table in Base.metadata.sorted_tables for row in s.execute(select(table)) for v in row]
    ctx.engine.dispose()
    assert "***" in recorded and make_url(url).host in recorded  # the URL is recorded, its password masked
    assert not [v for v in rows if secret in v]
    for run_id in (run_ledger.run_id, "creds"):
        for page in (None, RUN_HEALTH):
            at = open_app(monkeypatch, url, now=run_ledger.end, run=run_id, page=page)
            shown = everything_shown(at)
            assert run_id in shown
            assert secret not in shown
