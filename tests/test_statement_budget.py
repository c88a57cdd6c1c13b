"""SQL statements per learner step and per merge, counted on the wire (SQLite and PostgreSQL).

A learner step (H = P: one fragment sent per step) is one transaction of at most 3 statements amortized:
the registration, the heartbeat and the poll share one round trip (``LearnerLink.exchange``), each statement
compiled once (SQLAlchemy's compiled cache). A merge's commit (``publish_version``) is 4 statements, compiled once too.
BEGIN/COMMIT are counted as the transaction, not as statements."""

from __future__ import annotations

import re
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import Engine, event
from sqlalchemy.engine.interfaces import CacheStats
from support import tiny_config

from ddiloco.inprocess import SimClock, sim_learner
from ddiloco.platform.ledger import learner as learner_q
from ddiloco.platform.ledger import open_ledger, session_factory
from ddiloco.platform.ledger import reports as reports_q
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger import synchronizer as sync_q
from ddiloco.platform.runtime import RunContext
from ddiloco.synchronizer.service import Synchronizer

CONTROL = re.compile(r"^\s*(BEGIN|COMMIT|ROLLBACK|SAVEPOINT|RELEASE)\b", re.IGNORECASE)
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


@dataclass
class Counter:
    on: bool = False
    statements: int = 0
    transactions: int = 0
    seen: list[str] = field(default_factory=list)
    compiled: dict[str, int] = field(default_factory=dict)
    """Times each statement was compiled (a compiled-cache miss, or a statement SQLAlchemy cannot cache)."""


@contextmanager
def counting():
    """Count statements and transactions on every engine while ``counter.on``."""
    counter = Counter()

    def on_statement(conn, cursor, statement, parameters, context, executemany):  # noqa: ANN001, ARG001
        if counter.on and not CONTROL.match(statement):
            counter.statements += 1
            counter.seen.append(statement.split()[0])
            if context.cache_hit in (CacheStats.CACHE_MISS, CacheStats.NO_CACHE_KEY):
                counter.compiled[statement] = counter.compiled.get(statement, 0) + 1

    def on_begin(conn):  # noqa: ANN001
        if counter.on:
            counter.transactions += 1

    event.listen(Engine, "before_cursor_execute", on_statement)
    event.listen(Engine, "begin", on_begin)
    try:
        yield counter
    finally:
        event.remove(Engine, "before_cursor_execute", on_statement)
        event.remove(Engine, "begin", on_begin)


def test_a_learner_step_is_one_transaction_of_at_most_three_statements(ledger_url):
    """Two real learners and the real synchronizer (H = P = 4): per learner step, the step's upload
    registers, heartbeats and polls in one exchange; a heartbeat call between is free; and no statement is
    compiled twice (building or compiling SQL each step was most of the upload thread's work)."""
    cfg = tiny_config(
        ledger={"url": ledger_url}, storage={"url": f"memory://budget-{uuid.uuid4().hex[:8]}"},
        learners={"regions": [{"name": "us", "learners": 2}], "heartbeat_s": 2.0},
    )
    clock = SimClock()
    ctx = RunContext(cfg=cfg, run_id=cfg.name, engine=open_ledger(ledger_url), clock=clock)
    try:
        sync = Synchronizer(ctx, holder="sync")
        sync.poll_once(clock.t)
        learners = [sim_learner(ctx, lid) for lid in ("us-0", "us-1")]
        for learner in learners:
            learner.start(clock.t)
        steps = 0
        with counting() as counter:
            for _ in range(4 * cfg.fragments.count):
                clock.t += 1.0
                for learner in learners:
                    counter.on = True
                    learner.step(clock.t)
                    learner.link.uploader.pump()
                    learner.heartbeat(clock.t)
                    counter.on = False
                    steps += 1
                sync.poll_once(clock.t)
        assert sync.state and max(st.version for st in sync.state.values()) >= 2  # merges did happen meanwhile
        print(f"learner step: {counter.transactions / steps:.2f} transactions, {counter.statements / steps:.2f} statements")
        assert counter.transactions <= steps, counter
        assert counter.statements <= 3 * steps, (counter.statements / steps, counter.seen[:12])
        assert counter.compiled and max(counter.compiled.values()) == 1, counter.compiled
    finally:
        ctx.engine.dispose()


def test_a_merge_commits_in_four_statements(ledger_url):
    engine = open_ledger(ledger_url)
    S = session_factory(engine)
    blob = sync_q.BlobRef("b", "a" * 64, 1)
    try:
        with S.begin() as s:
            runs_q.create_run(s, "r", config_json="{}", code_version="t", git_commit=None, num_fragments=1, token_budget=1, now=T0)
            token = sync_q.acquire_lease(s, "r", "sync", 3600, T0)
            for i in range(8):
                learner_q.register_learner(s, "r", f"l{i}", "us", T0)
            sync_q.publish_version(s, "r", 0, 0, blob=blob, state=blob, holder="sync", token=token, now=T0)
        merges = 3
        with counting() as counter:
            for version in range(1, merges + 1):
                now = T0 + timedelta(seconds=version)
                with S.begin() as s:
                    ids = [learner_q.register_submission(s, "r", f"l{i}", 0, learner_q.SubmissionIn(
                        f"v{version}-{i}", 0, version - 1, 4, 100, 100, 100 * version, f"k{version}-{i}", "c" * 64, 10, "int8"), now)[0]
                        for i in range(8)]
                with S.begin() as s:
                    counter.on = True
                    sync_q.publish_version(
                        s, "r", 0, version, blob=blob, state=blob, holder="sync", token=token, now=now,
                        merged=[sync_q.MergedIn(i, 1.0, 1.0, 0) for i in ids],
                        record=sync_q.MergeRecord(1, 8, 0.0, 0.0, 0.0, "quorum", {}),
                    )
                    counter.on = False
        assert counter.statements <= 4 * merges, counter.seen
        assert counter.compiled and max(counter.compiled.values()) == 1, counter.compiled
        with S() as s:
            assert reports_q.token_accounting(s, "r").merged == 8 * 100 * merges  # the totals the statements kept
    finally:
        engine.dispose()


@pytest.mark.parametrize("superseded", [False, True])
def test_an_exchange_of_a_superseded_incarnation_registers_nothing_live(ledger_url, superseded):
    """The one-round-trip exchange keeps the registration rules: a superseded incarnation's submission is
    rejected and its row untouched, the current one's is pending with its heartbeat written."""
    engine = open_ledger(ledger_url)
    S = session_factory(engine)
    blob = sync_q.BlobRef("b", "a" * 64, 1)
    try:
        with S.begin() as s:
            runs_q.create_run(s, "r", config_json="{}", code_version="t", git_commit=None, num_fragments=1, token_budget=1, now=T0)
            token = sync_q.acquire_lease(s, "r", "sync", 3600, T0)
            sync_q.publish_version(s, "r", 0, 0, blob=blob, state=blob, holder="sync", token=token, now=T0)
            learner_q.register_learner(s, "r", "l", "us", T0)
            if superseded:
                learner_q.register_learner(s, "r", "l", "us", T0)
        sub = learner_q.SubmissionIn("u", 0, 0, 4, 100, 100, 100, "k", "c" * 64, 10, "int8")
        beat = learner_q.Beat(step=7, tokens=120, loss=2.5, tokens_per_s=10.0, step_time_s=0.1)
        with S.begin() as s:
            got = learner_q.learner_exchange(s, "r", "l", 0, [sub], beat, T0 + timedelta(seconds=1))
        assert got.current is not superseded and got.run_status == "running"
        assert {f: h.version for f, h in got.heads.items()} == {0: 0}
        with S() as s:
            row = {r.id: r for r in runs_q.learners(s, "r")}["l"]
            pending = sync_q.pending_submissions(s, "r")
            assert reports_q.token_accounting(s, "r").balanced
        if superseded:
            assert pending == [] and row.step == 0 and row.loss is None
        else:
            assert [p.uid for p in pending] == ["u"] and (row.step, row.loss, row.submissions) == (7, 2.5, 1)
    finally:
        engine.dispose()


def test_an_exchange_returns_only_the_heads_newer_than_the_learner_has_seen(ledger_url):
    """A learner polling several times a second is not sent the same heads (and their compact forms) again: the
    exchange returns a fragment's head only when it is newer than the version the learner says it has seen."""
    engine = open_ledger(ledger_url)
    S = session_factory(engine)
    blob = sync_q.BlobRef("b", "a" * 64, 1)
    form = '{"codec":"int8","base":0}'
    try:
        with S.begin() as s:
            runs_q.create_run(s, "r", config_json="{}", code_version="t", git_commit=None, num_fragments=3, token_budget=1, now=T0)
            token = sync_q.acquire_lease(s, "r", "sync", 3600, T0)
            for f in range(3):
                sync_q.publish_version(s, "r", f, 0, blob=blob, state=blob, holder="sync", token=token, now=T0, compact_json=form)
            sync_q.publish_version(s, "r", 1, 1, blob=blob, state=blob, holder="sync", token=token, now=T0, compact_json=form)
            learner_q.register_learner(s, "r", "l", "us", T0)

        def heads(known):
            with S.begin() as s:
                return {f: h.version for f, h in learner_q.learner_exchange(s, "r", "l", 0, [], None, T0, known=known).heads.items()}

        assert heads(None) == {0: 0, 1: 1, 2: 0}
        assert heads({}) == {0: 0, 1: 1, 2: 0}
        assert heads({0: 0, 1: 0, 2: 0}) == {1: 1}
        assert heads({0: 0, 1: 1, 2: 0}) == {}
        assert heads({0: 0, 2: 0}) == {1: 1}  # a fragment it has not seen comes whole
        with S.begin() as s:
            got = learner_q.learner_exchange(s, "r", "l", 0, [], None, T0, known={0: 0, 2: 0}).heads[1]
        assert got.compact_json == form and got.sha256 == "a" * 64
    finally:
        engine.dispose()
