"""Every report read is planned the same at any history, on SQLite and on PostgreSQL (#27).

A run's history is written by bulk inserts at two lengths (``ddiloco.testing.history``), and each read the summary
and the dashboard make runs on both. A read fails when its plan scans a history table (SQLite's ``SCAN``,
PostgreSQL's ``Seq Scan``) or when the work it does grows with the history: SQLite's virtual-machine steps (a
progress handler counts them), PostgreSQL's rows through every plan node (``EXPLAIN ANALYZE``). The work catches
what the plan's text does not: the staleness read's bad plan was a ``SEARCH`` of the poll index, walking every
merged submission. SQLite is checked with no statistics (a real ledger: nothing runs ``ANALYZE``), with current
ones and with stale ones (analyzed while the run was 5x shorter), as an operator's ``ANALYZE`` would leave them.

``ledger check``'s reads (``reports.scanned_tokens``, ``invariants.read_snapshot``) are full scans by design: they
hold the running totals to one, after an incident."""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, event
from sqlalchemy.orm import Session

from ddiloco.platform.ledger import dashboard as dash_q
from ddiloco.platform.ledger import reports as reports_q
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger import synchronizer as sync_q
from ddiloco.platform.ledger.engine import make_engine, upgrade
from ddiloco.testing.history import RUN, T0, fill
from ddiloco.ui import queries as uq

pytestmark = pytest.mark.timeout(300)
SHORT, LONG = 400, 2_000
"""Versions per fragment of the two histories."""
FRAGMENTS = 8
GROWTH_ALLOWED = 1.3
"""Work on the 5x longer history may exceed the short one's by this factor (sampling grids land differently)."""
HISTORY_TABLES = ("submissions", "fragment_versions", "heartbeats", "merges", "events", "evaluations")
NOW = T0 + timedelta(days=400)


def _fates(s: Session) -> Any:
    return dash_q.learner_fates(s, RUN, dash_q.learner_rows(s, RUN))


# Each with caps small enough that both histories fill them: what is left to grow is the history.
READS: dict[str, Callable[[Session], Any]] = {
    "summary (run_aggregates)": lambda s: reports_q.run_aggregates(s, RUN),
    "token_accounting": lambda s: reports_q.token_accounting(s, RUN),
    "last_version_at / last_merge_at": lambda s: (reports_q.last_version_at(s, RUN), reports_q.last_merge_at(s, RUN)),
    "learner verdicts and leases": lambda s: (runs_q.read_learner_snapshots(s, RUN), sync_q.leases(s, RUN), runs_q.get_run(s, RUN)),
    "run_ids": dash_q.run_ids,
    "learner_rows + learner_fates": _fates,
    "synchronizer_holders": lambda s: dash_q.synchronizer_holders(s, RUN),
    "version_timeline": lambda s: dash_q.version_timeline(s, RUN, max_points=50),
    "newest_merges": lambda s: dash_q.newest_merges(s, RUN, limit=20),
    "staleness_counts": lambda s: dash_q.staleness_counts(s, RUN, versions=20),
    "evaluation_samples": lambda s: dash_q.evaluation_samples(s, RUN, points=20),
    "loss_samples": lambda s: dash_q.loss_samples(s, RUN, per_learner=10, budget=80),
    "newest_events": lambda s: dash_q.newest_events(s, RUN, limit=20),
    "newest_rejections": lambda s: dash_q.newest_rejections(s, RUN, limit=5),
    "run_end_detail": lambda s: dash_q.run_end_detail(s, RUN, "failed"),
}


@dataclass
class Capture:
    """Statements an engine ran (while ``on``), with their parameters."""

    on: bool = False
    statements: list[tuple[str, Any]] = field(default_factory=list)

    def attach(self, engine: Engine) -> None:
        def seen(conn, cursor, statement, parameters, context, executemany):  # noqa: ANN001, ARG001
            if self.on and re.match(r"\s*(SELECT|WITH)\b", statement, re.IGNORECASE):
                self.statements.append((statement, parameters))

        event.listen(engine, "before_cursor_execute", seen)


def _shape(statement: str) -> str:
    """A statement with its expanded IN lists and time grid folded, so the same read matches at any length of them."""
    statement = re.sub(r"(SELECT \? AS t UNION ALL )+SELECT \? AS t", "grid", statement)  # a time grid of any size
    return re.sub(r"\(\s*(?:\?|%\(\w+\)s|__\[POSTCOMPILE_\w+\])(?:\s*,\s*(?:\?|%\(\w+\)s))*\s*\)", "(…)", statement)


@pytest.fixture(scope="module")
def histories(tmp_path_factory) -> dict[int, str]:
    """The two SQLite ledgers, filled at schema 0003 and upgraded in place, with no statistics."""
    urls = {}
    for n in (SHORT, LONG):
        url = f"sqlite:///{tmp_path_factory.mktemp(f'hist{n}')}/ledger.db"
        fill(url, n, fragments=FRAGMENTS, analyze=False)
        engine = make_engine(url)
        upgrade(engine)
        engine.dispose()
        urls[n] = url
    return urls


def _set_statistics(urls: dict[int, str], state: str) -> None:
    paths = {n: url.removeprefix("sqlite:///") for n, url in urls.items()}
    for n in (SHORT, LONG):
        with sqlite3.connect(paths[n], isolation_level=None) as con:
            con.execute("DROP TABLE IF EXISTS sqlite_stat1")
            if state == "current" or (state == "stale" and n == SHORT):
                con.execute("ANALYZE")
    if state == "stale":  # the long history planned by what ANALYZE saw when it was the short one
        with sqlite3.connect(paths[LONG], isolation_level=None) as con:
            con.execute("ANALYZE sqlite_schema")  # creates sqlite_stat1
            con.execute("DELETE FROM sqlite_stat1")
            con.execute("ATTACH ? AS short", (paths[SHORT],))
            con.execute("INSERT INTO sqlite_stat1 SELECT * FROM short.sqlite_stat1")
            con.execute("DETACH short")


def _sqlite_work(url: str) -> tuple[dict[str, int], dict[str, list[str]]]:
    """VM steps of each read (in units of 100), and the plans of its statements."""
    engine = uq.read_only_engine(url)
    steps = [0]

    @event.listens_for(engine, "connect")
    def count(dbapi_conn, _record):  # noqa: ANN001
        def tick() -> int:
            steps[0] += 1
            return 0

        dbapi_conn.set_progress_handler(tick, 100)

    capture = Capture()
    capture.attach(engine)
    work, plans = {}, {}
    try:
        for name, read in READS.items():
            with Session(engine) as s:
                read(s)  # warm: the connection, the schema, compiled statements
                s.rollback()
                capture.statements.clear()
                capture.on, before = True, steps[0]
                read(s)
                work[name], capture.on = steps[0] - before, False
                raw = s.connection().connection.driver_connection
                plans[name] = [f"{' '.join(stmt.split())[:100]}…\n    " + "\n    ".join(
                    row[3] for row in raw.execute("EXPLAIN QUERY PLAN " + stmt, params or ()).fetchall())
                    for stmt, params in capture.statements]
                s.rollback()
    finally:
        engine.dispose()
    return work, plans


def _scans(plans: list[str], pattern: str) -> list[str]:
    return [p for p in plans if re.search(pattern, p)]


def _long_tables(url: str) -> str:
    """The history tables holding more than a few pages, as a regex alternation: a table of a few pages is read whole
    by design, on statistics that say so (its index would cost more)."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return "|".join(t for t in HISTORY_TABLES if conn.exec_driver_sql(f"SELECT count(*) FROM {t}").scalar() > 1_000)
    finally:
        engine.dispose()


@pytest.mark.parametrize("statistics", ["none", "current", "stale"])
def test_report_reads_plan_the_same_whatever_the_history_on_sqlite(histories, statistics):
    _set_statistics(histories, statistics)
    short, _ = _sqlite_work(histories[SHORT])
    long, plans = _sqlite_work(histories[LONG])
    scan = rf"\bSCAN ({_long_tables(histories[LONG])})\b"
    problems = [f"{name}: {short[name]} -> {long[name]} (x100 VM steps) at 5x the history\n  " + "\n  ".join(plans[name])
                for name in READS if long[name] > GROWTH_ALLOWED * short[name] + 2 or _scans(plans[name], scan)]
    assert not problems, "\n".join(problems)


def test_the_page_reads_nothing_the_plan_test_does_not(histories):
    """The run page and the overview read only statements the reads above cover, so a new read cannot skip this test."""
    covered, page = Capture(), Capture()
    for capture, reads in ((covered, READS.values()),
                           (page, [lambda s: uq.run_page(s, RUN, NOW), lambda s: uq.runs_overview(s, NOW)])):
        engine = uq.read_only_engine(histories[SHORT])
        capture.attach(engine)
        capture.on = True
        try:
            for read in reads:
                with Session(engine) as s:
                    read(s)
        finally:
            engine.dispose()
    missing = {_shape(st) for st, _ in page.statements} - {_shape(st) for st, _ in covered.statements}
    assert page.statements and not missing, sorted(missing)


# --- PostgreSQL -------------------------------------------------------------------------------------------


def _pg_rows(plan: dict[str, Any]) -> int:
    """Rows through every node of an EXPLAIN ANALYZE plan, those its filters removed included."""
    loops = plan.get("Actual Loops", 1)
    own = (plan.get("Actual Rows", 0) + plan.get("Rows Removed by Filter", 0) + plan.get("Rows Removed by Index Recheck", 0)) * loops
    return int(own + sum(_pg_rows(child) for child in plan.get("Plans", [])))


def _pg_nodes(plan: dict[str, Any]) -> list[str]:
    here = f"{plan['Node Type']} on {plan['Relation Name']}" if "Relation Name" in plan else plan["Node Type"]
    return [here, *(n for child in plan.get("Plans", []) for n in _pg_nodes(child))]


def _postgres_work(url: str) -> tuple[dict[str, int], dict[str, list[str]]]:
    engine = uq.read_only_engine(url)
    capture = Capture()
    capture.attach(engine)
    work, plans = {}, {}
    try:
        for name, read in READS.items():
            with Session(engine) as s:
                capture.statements.clear()
                capture.on = True
                read(s)
                capture.on = False
                work[name], plans[name] = 0, []
                cur = s.connection().connection.driver_connection.cursor()
                for stmt, params in capture.statements:
                    cur.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + stmt, params)
                    plan = cur.fetchone()[0][0]["Plan"]
                    work[name] += _pg_rows(plan)
                    plans[name].append(f"{' '.join(stmt.split())[:100]}…: {', '.join(_pg_nodes(plan))}")
                s.rollback()
    finally:
        engine.dispose()
    return work, plans


@pytest.mark.postgres
def test_report_reads_plan_the_same_whatever_the_history_on_postgresql(postgres_url):
    from ddiloco.testing.postgres import scratch_database

    work, plans = {}, {}
    for n in (SHORT, LONG):
        with scratch_database(postgres_url, prefix="ddiloco_plans") as url:
            fill(url, n, fragments=FRAGMENTS)  # with the statistics autovacuum would gather
            engine = make_engine(url)
            upgrade(engine)
            engine.dispose()
            work[n], plans[n] = _postgres_work(url)
            long_tables = _long_tables(url)
    scan = rf"Seq Scan on ({long_tables})\b"
    problems = [f"{name}: {work[SHORT][name]} -> {work[LONG][name]} rows at 5x the history\n  " + "\n  ".join(plans[LONG][name])
                for name in READS
                if work[LONG][name] > GROWTH_ALLOWED * work[SHORT][name] + 50 or _scans(plans[LONG][name], scan)]
    assert not problems, "\n".join(problems)
