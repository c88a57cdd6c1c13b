"""Ledgers for the dashboard tests, filled by a real short in-process run (shared by the UI test files)."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import func, select
from support import tiny_config

from ddiloco.inprocess import Outage, run_inprocess
from ddiloco.platform.ledger import make_engine, session_factory
from ddiloco.platform.ledger.models import Heartbeat

RUN = "ui"
STEP_S = 7.0
"""Simulated seconds per inner step: long enough that a learner taken down is declared dead."""


def ui_config():
    return tiny_config(
        name=RUN,
        learners={
            "batch_size": 4,
            # eu-0 runs at 0.4x: its (simulated) step time is 2.5x the median, so it straggles.
            "regions": [{"name": "us", "learners": 2}, {"name": "eu", "learners": 2, "speeds": [0.4, 1.0]}],
            "heartbeat_s": 1.0,
            "dead_after_s": 45.0,
            "straggler_factor": 2.0,
        },
        synchronizer={"lease_ttl_s": 60.0, "poll_s": 1.0},
        merge={"max_staleness": 0},
    )


@dataclass(frozen=True)
class RunLedger:
    url: str
    path: Path
    run_id: str
    end: datetime
    """The newest heartbeat: 'now' for looking at the run as its operator saw it at the end."""


def build_run_ledger(directory: Path) -> RunLedger:
    """A real in-process run copied to a SQLite file: 4 learners in 2 regions; us-1 restarts, eu-1 dies
    for good, eu-0 straggles."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "ledger.db"
    if not path.exists():
        import torch

        threads = torch.get_num_threads()
        # One intra-op thread: the model is tiny, and on a busy 2-core machine two threads spin
        # against each other (a step then takes ~10x longer).
        torch.set_num_threads(1)
        try:
            run = run_inprocess(
                ui_config(),
                total_tokens=4 * 32 * 24,
                step_time_s=STEP_S,
                outages=[Outage("us-1", 8.0, 20.0), Outage("eu-1", 11.0, None)],
                eval_every_tokens=4 * 32 * 8,
            )
        finally:
            torch.set_num_threads(threads)
        tmp = directory / "ledger.db.tmp"
        src = run.ctx.engine.raw_connection()
        try:
            dst = sqlite3.connect(tmp)
            src.driver_connection.backup(dst)
            dst.close()
        finally:
            src.close()
        run.ctx.engine.dispose()
        tmp.rename(path)
    url = f"sqlite:///{path}"
    engine = make_engine(url, read_only=True)
    with session_factory(engine)() as s:
        end = s.scalar(select(func.max(Heartbeat.at)).where(Heartbeat.run_id == RUN))
    engine.dispose()
    return RunLedger(url=url, path=path, run_id=RUN, end=end)


def copy_ledger(src: RunLedger, directory: Path) -> RunLedger:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "ledger.db"
    with sqlite3.connect(src.path) as a, sqlite3.connect(path) as b:
        a.backup(b)
    return RunLedger(url=f"sqlite:///{path}", path=path, run_id=src.run_id, end=src.end)


def shift_times(ledger: RunLedger, end: datetime) -> RunLedger:
    """Move every timestamp of a copied test ledger so the run's newest heartbeat is at ``end``."""
    from sqlalchemy import update

    from ddiloco.platform.ledger.models import Base, UtcDateTime

    # Every timestamp column of every table (so a new one cannot be missed), and the float seconds
    # the heads keep beside their timestamps.
    seconds_columns = {"published_s"}
    delta: timedelta = end - ledger.end
    engine = make_engine(ledger.url)
    with session_factory(engine).begin() as s:
        for table in Base.metadata.sorted_tables:
            columns = [c.name for c in table.columns if isinstance(c.type, UtcDateTime) or c.name in seconds_columns]
            if not columns or table.name == "alembic_version":
                continue
            key = list(table.primary_key.columns)
            rows = s.execute(select(*key, *[table.c[c] for c in columns])).all()
            for row in rows:
                values = {
                    c: None if v is None else v + (delta.total_seconds() if c in seconds_columns else delta)
                    for c, v in zip(columns, row[len(key) :])
                }
                s.execute(update(table).where(*[k == v for k, v in zip(key, row[: len(key)])]).values(**values))
    engine.dispose()
    return RunLedger(url=ledger.url, path=ledger.path, run_id=ledger.run_id, end=end)


def config_of(ledger: RunLedger) -> dict:
    from ddiloco.platform.ledger.models import Run

    engine = make_engine(ledger.url, read_only=True)
    with session_factory(engine)() as s:
        cfg = json.loads(s.get(Run, ledger.run_id).config_json)
    engine.dispose()
    return cfg


def copy_ledger_to(src_url: str, dst_url: str) -> None:
    """Copy every row of a ledger into an empty database of another backend (migrated first)."""
    from sqlalchemy import insert

    from ddiloco.platform.ledger import upgrade
    from ddiloco.platform.ledger.models import Base

    src, dst = make_engine(src_url), make_engine(dst_url)
    upgrade(dst)
    with src.connect() as a, dst.begin() as b:
        for table in Base.metadata.sorted_tables:
            rows = [dict(r) for r in a.execute(select(table)).mappings()]
            if rows:
                b.execute(insert(table), rows)
        if dst.dialect.name == "postgresql":
            # Rows came with their ids: move each id sequence past them, so new rows can be added.
            for table in Base.metadata.sorted_tables:
                if "id" in table.c and table.c.id.primary_key and table.c.id.type.python_type is int:
                    b.exec_driver_sql(
                        f"SELECT setval(pg_get_serial_sequence('{table.name}', 'id'), COALESCE(MAX(id), 0) + 1, false) FROM {table.name}"
                    )
    src.dispose()
    dst.dispose()


EVIL = "evil.example"
"""A host no operator configured: no page may link to it."""
PHISH = f"[URGENT re-login](https://{EVIL}/login)"


def plant_markup(ledger: RunLedger) -> None:
    """Markup and hostile links planted wherever a ledger writer controls text: the run's code version,
    commit and flow-run URL, a second run whose id is a link, learners' flow-run URLs, the
    synchronizer's label and an event. Rows are written straight into the tables: the ledger's own
    functions refuse such ids at registration."""
    from sqlalchemy import update

    from ddiloco.platform.ledger.models import Event, FragmentVersion, Learner, Run, SynchronizerLease

    engine = make_engine(ledger.url)
    with session_factory(engine).begin() as s:
        run = s.get(Run, ledger.run_id)
        run.flow_run_url = "javascript:alert(document.cookie)"
        run.code_version = PHISH
        run.git_commit = f"https://{EVIL}/c"
        s.add(Run(id=PHISH, created_at=run.created_at, status="running", config_json=run.config_json, code_version=PHISH,
                  git_commit=None, num_fragments=run.num_fragments, token_budget=run.token_budget,
                  flow_run_url=f"javascript:fetch('https://{EVIL}')"))
        s.execute(update(Learner).where(Learner.run_id == ledger.run_id).values(flow_run_url=f"javascript:location='https://{EVIL}'"))
        s.execute(update(SynchronizerLease).values(holder=PHISH))
        s.execute(update(FragmentVersion).where(FragmentVersion.run_id == ledger.run_id).values(synchronizer=PHISH))
        s.add(Event(run_id=ledger.run_id, at=ledger.end - timedelta(seconds=5), kind="chaos", actor=PHISH, detail=PHISH))
        # A learner's link report: a hostile reason, and one that is not JSON at all.
        s.execute(update(Learner).where(Learner.run_id == ledger.run_id, Learner.id == "us-0").values(
            link_json=json.dumps({"adaptive": True, "every": 8, "codec": PHISH, "reason": PHISH, "up_bps": 1e6})))
        s.execute(update(Learner).where(Learner.run_id == ledger.run_id, Learner.id == "us-1").values(link_json="<a href='x'>"))
        s.add(Event(run_id=ledger.run_id, at=ledger.end - timedelta(seconds=4), kind="link_cadence", actor="us-0", detail=PHISH))
    engine.dispose()
