"""The ledger's rules, on SQLite and PostgreSQL: schema, idempotency, accounting, fencing, versions, GC."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import func, inspect, select, text
from sqlalchemy.exc import StatementError

from ddiloco.platform import liveness
from ddiloco.platform.ledger import errors as errors_q
from ddiloco.platform.ledger import learner as learner_q
from ddiloco.platform.ledger import open_ledger, session_factory
from ddiloco.platform.ledger import rejections as rejections_q
from ddiloco.platform.ledger import reports as reports_q
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger import synchronizer as sync_q
from ddiloco.platform.ledger.engine import alembic_config
from ddiloco.platform.ledger.models import MERGED, PENDING, REJECTED, Base, Heartbeat, Run, Submission

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
RUN = "r1"
BLOB = sync_q.BlobRef("r1/global/f0/v0.safetensors", "a" * 64, 100)
STATE = sync_q.BlobRef("r1/outer/f0/v0.safetensors", "b" * 64, 50)
EXPECTED_TABLES = {
    "alembic_version",
    "runs",
    "fragment_specs",
    "learners",
    "heartbeats",
    "submissions",
    "fragment_versions",
    "fragment_heads",
    "merges",
    "events",
    "evaluations",
    "synchronizer_leases",
    "rejection_totals",
}


@pytest.fixture
def ledger(ledger_url):
    engine = open_ledger(ledger_url)
    try:
        yield engine, session_factory(engine)
    finally:
        engine.dispose()


@pytest.fixture
def run(ledger):
    """A run with 2 fragments and a synchronizer holding the lease (token 1, TTL 1 h from T0)."""
    engine, S = ledger
    with S.begin() as s:
        runs_q.create_run(s, RUN, config_json="{}", code_version="t", git_commit=None, num_fragments=2, token_budget=10_000, now=T0)
        assert sync_q.acquire_lease(s, RUN, "sync", 3600, T0) == 1
    return S


def sub(uid: str, fragment: int = 0, base: int = 0, tokens_new: int = 100, tokens_total: int = 100) -> learner_q.SubmissionIn:
    return learner_q.SubmissionIn(uid, fragment, base, 4, tokens_new, tokens_new, tokens_total, f"k/{uid}", "c" * 64, 10, "int8")


def publish(S, version: int, fragment: int = 0, *, holder: str = "sync", token: int = 1, now: datetime = T0, **kw):
    with S.begin() as s:
        return sync_q.publish_version(s, RUN, fragment, version, blob=BLOB, state=STATE, holder=holder, token=token, now=now, **kw)


# --- schema ---------------------------------------------------------------------------------------


def test_migration_creates_schema_and_is_idempotent(ledger_url):
    from ddiloco.platform.ledger.engine import at_head, head_revision, make_engine

    empty = make_engine(ledger_url)
    assert not at_head(empty)  # a new ledger is migrated, not taken for one at the head
    empty.dispose()
    engine = open_ledger(ledger_url)
    try:
        assert at_head(engine)
        open_ledger(ledger_url).dispose()  # the second opening finds it at the head
        insp = inspect(engine)
        assert set(insp.get_table_names()) == EXPECTED_TABLES
        index_names = {ix["name"] for ix in insp.get_indexes("submissions")}
        assert "ix_submissions_poll" in index_names
        with engine.connect() as conn:
            from alembic.script import ScriptDirectory

            head = ScriptDirectory.from_config(alembic_config()).get_current_head()
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == head == head_revision()
            # The schema is the one the models describe (built from them: the migrations' is compared below).
            from alembic.autogenerate import compare_metadata
            from alembic.migration import MigrationContext

            assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
        with session_factory(engine).begin() as s:
            runs_q.create_run(s, "keep", config_json="{}", code_version="t", git_commit=None, num_fragments=1, token_budget=1, now=T0)
    finally:
        engine.dispose()

    again = open_ledger(ledger_url)  # second open: upgrade is a no-op and keeps data
    try:
        assert set(inspect(again).get_table_names()) == EXPECTED_TABLES
        with again.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM alembic_version")).scalar_one() == 1
        with session_factory(again)() as s:
            assert [r.id for r in runs_q.list_runs(s)] == ["keep"]
    finally:
        again.dispose()


def schema_of(engine) -> dict:
    """Every table's columns (by name: a migration adds its columns last), keys, indexes and constraints, as the
    database reports them."""
    insp = inspect(engine)
    schema = {}
    for table in sorted(insp.get_table_names()):
        schema[table] = {
            "columns": sorted((c["name"], str(c["type"]), c["nullable"], str(c.get("default"))) for c in insp.get_columns(table)),
            "primary_key": sorted(insp.get_pk_constraint(table)["constrained_columns"]),
            "indexes": sorted((ix["name"], tuple(ix["column_names"]), bool(ix["unique"])) for ix in insp.get_indexes(table)),
            "unique": sorted(tuple(sorted(u["column_names"])) for u in insp.get_unique_constraints(table)),
            "foreign_keys": sorted((tuple(fk["constrained_columns"]), fk["referred_table"], tuple(fk["referred_columns"]),
                                    str(fk.get("options", {}).get("ondelete"))) for fk in insp.get_foreign_keys(table)),
            "checks": sorted(str(c["sqltext"]) for c in insp.get_check_constraints(table)),
        }
    return schema


def test_a_new_ledger_is_created_from_the_models_with_the_schema_the_migrations_build(ledger_url):
    """A new ledger is made from the models and stamped at the head (a fifth of the CPU of running every migration);
    running every migration instead builds the same tables, columns, defaults, keys, indexes and constraints."""
    from ddiloco.platform.ledger.engine import at_head, head_revision, make_engine, upgrade

    engine = make_engine(ledger_url)
    try:
        upgrade(engine, replay=True)
        assert at_head(engine)
        migrated = schema_of(engine)
        with engine.connect() as conn:
            from alembic.autogenerate import compare_metadata
            from alembic.migration import MigrationContext

            assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
        with engine.begin() as conn:
            Base.metadata.drop_all(conn)
            conn.execute(text("DROP TABLE alembic_version"))
        assert inspect(engine).get_table_names() == []
        upgrade(engine)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all() == [head_revision()]
        assert set(migrated) == EXPECTED_TABLES
        assert schema_of(engine) == migrated
    finally:
        engine.dispose()


def test_create_run_is_idempotent(ledger):
    _, S = ledger
    with S.begin() as s:
        assert runs_q.create_run(
            s, RUN, config_json='{"a": 1}', code_version="t", git_commit="abc", num_fragments=3, token_budget=5, now=T0
        )
    with S.begin() as s:
        assert not runs_q.create_run(
            s, RUN, config_json='{"a": 2}', code_version="u", git_commit=None, num_fragments=9, token_budget=9, now=T0
        )
    with S() as s:
        runs = runs_q.list_runs(s)
        assert len(runs) == 1 and runs[0].config_json == '{"a": 1}' and runs[0].num_fragments == 3
        assert [e.kind for e in runs_q.events(s, RUN)] == ["run_created"]
        with pytest.raises(errors_q.UnknownRunError):
            runs_q.require_run(s, "nope")


def test_a_run_ends_once_and_its_first_end_stands(run):
    S = run
    with S.begin() as s:
        assert runs_q.set_run_status(s, RUN, runs_q.STOPPED, T0 + timedelta(seconds=5), detail="by hand: ddiloco run stop")
        # A supervisor or a synchronizer finishing it afterwards changes neither its status nor its end.
        assert not runs_q.set_run_status(s, RUN, runs_q.FINISHED, T0 + timedelta(seconds=9))
    with S() as s:
        r = runs_q.require_run(s, RUN)
        assert (r.status, r.finished_at) == (runs_q.STOPPED, T0 + timedelta(seconds=5))
        ends = [(e.kind, e.detail) for e in runs_q.events(s, RUN) if e.kind.startswith("run_") and e.kind != "run_created"]
        assert ends == [("run_stopped", "by hand: ddiloco run stop")]
    with S.begin() as s, pytest.raises(ValueError, match="a run ends as one of finished, stopped, failed, not 'running'"):
        runs_q.set_run_status(s, RUN, runs_q.RUNNING, T0)


def test_datetimes_read_back_timezone_aware(run):
    S = run
    local = T0.astimezone(timezone(timedelta(hours=5)))  # same instant, other offset
    with S.begin() as s:
        runs_q.create_run(s, "r2", config_json="{}", code_version="t", git_commit=None, num_fragments=1, token_budget=1, now=local)
    with S() as s:
        r = s.scalars(select(Run).where(Run.id == "r2")).one()
        assert r.created_at.tzinfo is not None and r.created_at.utcoffset() == timedelta(0)
        assert r.created_at == T0
        lease = sync_q.current_lease(s, RUN)
        assert lease.expires_at.utcoffset() == timedelta(0) and lease.expires_at == T0 + timedelta(hours=1)
    with S.begin() as s, pytest.raises(StatementError, match="timezone-aware"):
        runs_q.record_event(s, RUN, "x", None, "", datetime(2026, 1, 1))
        s.flush()


# --- learners and token accounting -------------------------------------------------------------------


def test_incarnations_and_token_accounting_stay_balanced(run):
    S = run

    def acct():
        with S() as s:
            a = reports_q.token_accounting(s, RUN)
            merged = runs_q.tokens_merged(s, RUN)  # what the synchronizer's budget check reads
        assert a.balanced, a
        assert merged == a.merged
        return a

    with S.begin() as s:
        assert learner_q.register_learner(s, RUN, "us-0", "us", T0) == 0
        assert learner_q.register_learner(s, RUN, "eu-0", "eu", T0) == 0
    assert acct() == reports_q.TokenAccounting(0, 0, 0, 0, 0, 0)

    with S.begin() as s:
        assert learner_q.record_heartbeat(s, RUN, "us-0", 0, now=T0, step=3, tokens=300, loss=2.0, tokens_per_s=10, step_time_s=0.1)
    assert acct() == reports_q.TokenAccounting(trained=300, merged=0, rejected=0, pending=0, lost=0, in_flight=300)

    with S.begin() as s:
        a_id, created = learner_q.register_submission(s, RUN, "us-0", 0, sub("a", tokens_new=200, tokens_total=200), T0)
        assert created
        b_id, _ = learner_q.register_submission(s, RUN, "us-0", 0, sub("b", fragment=1, tokens_new=150, tokens_total=350), T0)
    # The submission reported 350 tokens trained: more than the last heartbeat said.
    assert acct() == reports_q.TokenAccounting(trained=350, merged=0, rejected=0, pending=350, lost=0, in_flight=0)

    publish(S, 0)
    publish(S, 1, merged=[sync_q.MergedIn(a_id, 1.0, 1.0, 0)], record=sync_q.MergeRecord(1, 2, 0, 0, 0, "quorum", {}))
    with S.begin() as s:
        sync_q.reject_submissions(s, RUN, [(b_id, "norm outlier")], holder="sync", token=1, now=T0)
        learner_q.record_heartbeat(s, RUN, "us-0", 0, now=T0, step=5, tokens=500, loss=1.5, tokens_per_s=10, step_time_s=0.1)
    assert acct() == reports_q.TokenAccounting(trained=500, merged=200, rejected=150, pending=0, lost=0, in_flight=150)

    # Restart: the 150 unsubmitted tokens of incarnation 0 are lost; the new incarnation starts at 0.
    with S.begin() as s:
        assert learner_q.register_learner(s, RUN, "us-0", "us", T0 + timedelta(seconds=1)) == 1
    assert acct() == reports_q.TokenAccounting(trained=500, merged=200, rejected=150, pending=0, lost=150, in_flight=0)

    with S.begin() as s:
        # The old incarnation wakes up and heartbeats: refused, and it changes nothing.
        assert not learner_q.record_heartbeat(s, RUN, "us-0", 0, now=T0, step=9, tokens=900, loss=1.0, tokens_per_s=1, step_time_s=1)
        assert learner_q.record_heartbeat(s, RUN, "us-0", 1, now=T0, step=1, tokens=80, loss=1.0, tokens_per_s=1, step_time_s=1)
        learner = {row.id: row for row in runs_q.learners(s, RUN)}["us-0"]
        assert learner.incarnation == 1 and learner.status == "recovering"
    assert acct() == reports_q.TokenAccounting(trained=580, merged=200, rejected=150, pending=0, lost=150, in_flight=80)

    # A late submission from incarnation 0 is rejected, and its tokens move from lost to rejected.
    with S.begin() as s:
        late_id, created = learner_q.register_submission(s, RUN, "us-0", 0, sub("late", tokens_new=100, tokens_total=600), T0)
        assert created
    with S() as s:
        late = s.get(Submission, late_id)
        assert late.status == REJECTED and "superseded incarnation 0" in late.reject_reason
    assert acct() == reports_q.TokenAccounting(trained=580, merged=200, rejected=250, pending=0, lost=50, in_flight=80)

    with S.begin() as s:
        learner_q.register_submission(s, RUN, "us-0", 1, sub("c", tokens_new=80, tokens_total=80), T0)
    assert acct() == reports_q.TokenAccounting(trained=580, merged=200, rejected=250, pending=80, lost=50, in_flight=0)


def test_registration_records_the_incarnations_world_size_within_the_runs_limit(run):
    S = run
    with S.begin() as s:
        assert learner_q.register_learner(s, RUN, "us-0", "us", T0, world_size=2, max_world_size=8) == 0
        assert learner_q.register_learner(s, RUN, "eu-0", "eu", T0) == 0  # one rank unless told
    with S() as s:
        assert {r.id: r.world_size for r in runs_q.learners(s, RUN)} == {"us-0": 2, "eu-0": 1}
    with S.begin() as s:  # relaunched on one node of 8 ranks: the new incarnation's world is recorded
        assert learner_q.register_learner(s, RUN, "us-0", "us", T0 + timedelta(seconds=1), world_size=8, max_world_size=8) == 1
    # Above the run's limit: refused before anything is written, the current incarnation stands.
    with pytest.raises(errors_q.WorldSizeError, match="world size 9 is above learners.max_world_size 8"), S.begin() as s:
        learner_q.register_learner(s, RUN, "us-0", "us", T0 + timedelta(seconds=2), world_size=9, max_world_size=8)
    with pytest.raises(errors_q.WorldSizeError, match="at least one rank"), S.begin() as s:
        learner_q.register_learner(s, RUN, "new-0", "us", T0, world_size=0)
    with S() as s:
        rows = {r.id: r for r in runs_q.learners(s, RUN)}
    assert (rows["us-0"].incarnation, rows["us-0"].world_size) == (1, 8) and "new-0" not in rows


def test_register_submission_twice_is_a_noop(run):
    S = run
    with S.begin() as s:
        learner_q.register_learner(s, RUN, "us-0", "us", T0)
        first = learner_q.register_submission(s, RUN, "us-0", 0, sub("u1", tokens_new=100, tokens_total=100), T0)
    with S.begin() as s:
        # The same registration again (a retry): nothing changes.
        again = learner_q.register_submission(s, RUN, "us-0", 0, sub("u1", tokens_new=100, tokens_total=100), T0)
    assert first[1] is True and again == (first[0], False)
    # The same uid with other numbers is refused: its tokens would appear nowhere in the accounting.
    with pytest.raises(errors_q.SubmissionConflictError), S.begin() as s:
        learner_q.register_submission(s, RUN, "us-0", 0, sub("u1", fragment=1, tokens_new=999, tokens_total=999), T0)
    with S() as s:
        rows = s.scalars(select(Submission)).all()
        assert len(rows) == 1 and rows[0].fragment == 0 and rows[0].tokens_new == 100
        assert sync_q.pending_counts(s, RUN) == {0: 1}
        assert reports_q.token_accounting(s, RUN).pending == 100
        learner = runs_q.learners(s, RUN)[0]
        assert learner.inc_tokens_submitted == 100

def test_a_registration_larger_than_one_insert_statement_registers_each_once(run):
    S = run
    n = learner_q.INSERT_ROWS + 8
    with S.begin() as s:
        learner_q.register_learner(s, RUN, "us-0", "us", T0)
        first = learner_q.register_submissions(s, RUN, "us-0", 0, [sub(f"u{i}", tokens_total=100 * (i + 1)) for i in range(n)], T0)
    # A retry of the last few beside new ones, across the statement boundary: only the new ones are created.
    retry = [sub(f"u{i}", tokens_total=100 * (i + 1)) for i in range(n - 3, n)] + [sub(f"v{i}") for i in range(n)]
    with S.begin() as s:
        again = learner_q.register_submissions(s, RUN, "us-0", 0, retry, T0)
    assert [c for _, c in first] == [True] * n and len({i for i, _ in first}) == n
    assert again[:3] == [(i, False) for i, _ in first[-3:]] and [c for _, c in again[3:]] == [True] * n
    with S() as s:
        assert s.scalar(select(func.count()).select_from(Submission)) == 2 * n
        learner = runs_q.learners(s, RUN)[0]
        assert (learner.submissions, learner.inc_tokens_submitted, learner.inc_tokens_trained) == (2 * n, 200 * n, 100 * n)



def test_submission_from_unknown_learner_is_rejected(run):
    S = run
    with S.begin() as s:
        sid, created = learner_q.register_submission(s, RUN, "ghost", 0, sub("g"), T0)
    with S() as s:
        row = s.get(Submission, sid)
        assert created and row.status == REJECTED and "unknown learner" in row.reject_reason
        assert sync_q.pending_counts(s, RUN) == {}


# --- versions ---------------------------------------------------------------------------------------


def test_publish_version_is_dense(run):
    S = run
    assert publish(S, 0) is None
    with pytest.raises(errors_q.VersionConflictError, match="next version is v1"):
        publish(S, 2)  # a gap
    with pytest.raises(errors_q.VersionConflictError):
        publish(S, 0)  # a duplicate
    publish(S, 1)
    publish(S, 0, fragment=1)  # fragments are independent
    publish(S, 1, fragment=1)
    with pytest.raises(errors_q.VersionConflictError):
        publish(S, 1, fragment=1)  # not twice
    with S() as s:
        assert runs_q.latest_version_numbers(s, RUN) == {0: 1, 1: 1}
        assert {f: v.version for f, v in runs_q.latest_versions(s, RUN).items()} == {0: 1, 1: 1}
        v1 = runs_q.get_version(s, RUN, 0, 1)
        assert v1.lease_token == 1 and v1.synchronizer == "sync" and v1.blob_key == BLOB.key


def test_a_submission_is_merged_at_most_once(run):
    S = run
    with S.begin() as s:
        learner_q.register_learner(s, RUN, "us-0", "us", T0)
        a, _ = learner_q.register_submission(s, RUN, "us-0", 0, sub("a"), T0)
        b, _ = learner_q.register_submission(s, RUN, "us-0", 0, sub("b"), T0)
    publish(S, 0)
    rec = sync_q.MergeRecord(
        quorum=1, live_learners=1, grace_window_s=0.5, grace_waited_s=0.1, merge_s=0.01, reason="quorum", detail={"x": 1}
    )
    merge_id = publish(S, 1, merged=[sync_q.MergedIn(a, 2.0, 3.0, 0)], record=rec)
    assert merge_id is not None
    with pytest.raises(errors_q.AlreadyDecidedError, match=str(a)):
        publish(S, 2, merged=[sync_q.MergedIn(b, 1.0, 1.0, 0), sync_q.MergedIn(a, 1.0, 1.0, 0)], record=rec)
    with S() as s:
        # The refused publish left nothing behind: no v2, b still pending.
        assert runs_q.latest_version_numbers(s, RUN) == {0: 1}
        ra, rb = s.get(Submission, a), s.get(Submission, b)
        assert (ra.status, ra.merged_version, ra.merge_id, ra.weight, ra.norm) == (MERGED, 1, merge_id, 2.0, 3.0)
        assert rb.status == PENDING and rb.merged_version is None
        assert sync_q.pending_counts(s, RUN) == {0: 1}
    with pytest.raises(errors_q.AlreadyDecidedError):
        with S.begin() as s:
            sync_q.reject_submissions(s, RUN, [(a, "too late")], holder="sync", token=1, now=T0)


def test_reject_submissions_records_reasons(run):
    S = run
    with S.begin() as s:
        learner_q.register_learner(s, RUN, "us-0", "us", T0)
        ids = [learner_q.register_submission(s, RUN, "us-0", 0, sub(f"u{i}"), T0)[0] for i in range(3)]
    with S.begin() as s:
        reasons = [(ids[0], "stale: base v0, current v9"), (ids[1], "non-finite values")]
        sync_q.reject_submissions(s, RUN, reasons, holder="sync", token=1, now=T0)
    with pytest.raises(errors_q.LeaseLostError):
        with S.begin() as s:
            sync_q.reject_submissions(s, RUN, [(ids[2], "x")], holder="other", token=1, now=T0)
    with S() as s:
        rows = {r.id: r for r in s.scalars(select(Submission))}
        assert rows[ids[0]].status == REJECTED and rows[ids[0]].reject_reason == "stale: base v0, current v9"
        assert rows[ids[1]].reject_reason == "non-finite values" and rows[ids[1]].decided_at == T0
        assert rows[ids[2]].status == PENDING and rows[ids[2]].reject_reason is None
        details = [e.detail for e in runs_q.events(s, RUN) if e.kind == "submission_rejected"]
        assert sorted(details) == sorted([f"submission {ids[0]}: stale: base v0, current v9", f"submission {ids[1]}: non-finite values"])


def test_reasons_are_counted_by_their_class():
    assert rejections_q.reason_class("stale: based on v1, now v3") == rejections_q.reason_class("stale: based on v0, now v9") == "stale"
    assert rejections_q.reason_class("norm outlier: 9.1x the median") == "norm outlier"
    assert rejections_q.reason_class("superseded incarnation 3 (current 4)") == "superseded incarnation"
    assert rejections_q.reason_class("unknown learner 'x-9'") == "unknown learner"
    assert rejections_q.reason_class("Non-finite values") == "non finite values"
    assert rejections_q.reason_class(None) == rejections_q.reason_class("") == "unknown" and rejections_q.reason_class("42") == "other"
    assert len(rejections_q.reason_class("a" * 500)) == 48


def test_rejected_work_is_read_from_running_totals_not_the_rejected_rows(run):
    """Every rejection path (the synchronizer's, a merge's, a superseded incarnation's, an unknown learner's) keeps the
    (learner id, reason class) totals; the dashboard's per-learner fates and the summary's reasons and unowned
    submissions come from those few rows, equal to what a scan of the rejected submissions says."""
    from sqlalchemy import event

    from ddiloco.platform.invariants import read_snapshot, totals_problems
    from ddiloco.platform.ledger.dashboard import learner_fates

    S = run
    with S.begin() as s:
        learner_q.register_learner(s, RUN, "us-0", "us", T0)
        learner_q.register_learner(s, RUN, "eu-0", "eu", T0)
        ids = [learner_q.register_submission(s, RUN, "us-0", 0, sub(f"u{i}", tokens_new=10 + i), T0)[0] for i in range(6)]
        eu = learner_q.register_submission(s, RUN, "eu-0", 0, sub("e", fragment=1, tokens_new=7), T0)[0]
        learner_q.register_submission(s, RUN, "ghost", 0, sub("g", tokens_new=5), T0)  # rejected at registration
    publish(S, 0)
    publish(S, 0, fragment=1)
    with S.begin() as s:  # figures in every reason: one class each
        sync_q.reject_submissions(s, RUN, [(ids[i], f"stale: based on v{i}, now v9") for i in range(3)], holder="sync", token=1, now=T0)
    publish(S, 1, merged=[sync_q.MergedIn(ids[3], 1.0, 1.0, 0)], rejected=[(ids[4], "norm outlier: 9.1x")],
            record=sync_q.MergeRecord(1, 2, 1, 1, 0, "quorum", {}))
    publish(S, 1, fragment=1, rejected=[(eu, "stale: based on v0, now v3")], record=sync_q.MergeRecord(1, 2, 0, 1, 0, "quorum", {}))
    with S.begin() as s:
        learner_q.register_learner(s, RUN, "eu-0", "eu", T0)  # a replacement: the old incarnation's next send is superseded
        learner_q.register_submission(s, RUN, "eu-0", 0, sub("late", fragment=1, tokens_new=3), T0)

    def reads(fn):
        seen = []
        with S() as s:
            conn = s.connection()
            listen = lambda *a: seen.append((a[2], a[3]))  # noqa: E731
            event.listen(conn, "before_cursor_execute", listen)
            try:
                out = fn(s)
            finally:
                event.remove(conn, "before_cursor_execute", listen)
        # Neither the literal of the partial index nor a bound 'rejected': no statement reads the rejected rows.
        assert not [sql for sql, params in seen if "'rejected'" in sql or REJECTED in str(params)], seen
        return out

    with S() as s:
        totals = {(t.learner_id, t.reason): (t.submissions, t.tokens) for t in reports_q.rejected_totals(s, RUN)}
        assert totals == {("us-0", "stale"): (3, 10 + 11 + 12), ("us-0", "norm outlier"): (1, 14), ("eu-0", "stale"): (1, 7),
                          ("eu-0", "superseded incarnation"): (1, 3), ("ghost", "unknown learner"): (1, 5)}
        snap = read_snapshot(s, RUN)
        assert totals_problems(snap.stored, snap.scanned) == []
    agg = reads(lambda s: reports_q.run_aggregates(s, RUN))
    assert agg.rejected_reasons == {"stale": 4, "norm outlier": 1, "superseded incarnation": 1, "unknown learner": 1}
    assert (agg.submissions, agg.bytes_sent) == (9, 9 * 10)  # the ghost's counted once, by the totals
    fates = reads(lambda s: learner_fates(s, RUN, runs_q.learners(s, RUN)))
    assert (fates["us-0"].rejected, fates["us-0"].merged, fates["us-0"].pending) == (4, 1, 1)
    assert (fates["eu-0"].rejected, fates["eu-0"].merged, fates["eu-0"].tokens_merged) == (2, 0, 0)


# --- the lease --------------------------------------------------------------------------------------


def test_lease_acquire_renew_expire_takeover_and_fencing(ledger):
    _, S = ledger
    with S.begin() as s:
        runs_q.create_run(s, RUN, config_json="{}", code_version="t", git_commit=None, num_fragments=1, token_budget=1, now=T0)
    t = lambda sec: T0 + timedelta(seconds=sec)  # noqa: E731

    with S.begin() as s:
        assert sync_q.acquire_lease(s, RUN, "A", 3, t(0)) == 1
        assert sync_q.acquire_lease(s, RUN, "B", 3, t(1)) is None  # A's lease is live
        assert sync_q.acquire_lease(s, RUN, "A", 3, t(2)) == 1  # re-acquire = renew, same token
        assert sync_q.renew_lease(s, RUN, "A", 1, 3, t(4))  # now expires at t(7)
        assert not sync_q.renew_lease(s, RUN, "A", 2, 3, t(4))  # wrong token
        assert sync_q.acquire_lease(s, RUN, "B", 3, t(6.9)) is None
    publish(S, 0, holder="A", token=1, now=t(5))
    # A stops renewing: at t(7) its lease has expired even before anyone takes over.
    with pytest.raises(errors_q.LeaseLostError):
        publish(S, 1, holder="A", token=1, now=t(7))
    with S.begin() as s:
        assert sync_q.acquire_lease(s, RUN, "B", 3, t(8)) == 2  # takeover bumps the token
        assert not sync_q.renew_lease(s, RUN, "A", 1, 3, t(8.5))  # taken over: A cannot renew any more
    with pytest.raises(errors_q.LeaseLostError, match="token 1"):
        publish(S, 1, holder="A", token=1, now=t(8.5))  # the stale holder is fenced off
    with pytest.raises(errors_q.LeaseLostError):
        publish(S, 1, holder="A", token=2, now=t(8.5))  # right token, wrong holder
    publish(S, 1, holder="B", token=2, now=t(9))
    with S.begin() as s:
        sync_q.release_lease(s, RUN, "B", 2, t(9))
        assert sync_q.acquire_lease(s, RUN, "A", 3, t(9)) == 3  # released: taken at once
        assert not sync_q.renew_lease(s, RUN, "B", 2, 3, t(9))
    with S() as s:
        lease = sync_q.current_lease(s, RUN)
        assert (lease.holder, lease.token, lease.expires_at) == ("A", 3, t(12))
        assert [v.lease_token for v in (runs_q.get_version(s, RUN, 0, 0), runs_q.get_version(s, RUN, 0, 1))] == [1, 2]
        acquired = [e for e in reversed(runs_q.events(s, RUN)) if e.kind == "lease_acquired"]
        assert [(e.actor, e.detail.split(";")[0]) for e in acquired] == [("A", "token 1"), ("B", "token 2"), ("A", "token 3")]


def test_a_lapsed_lease_nobody_took_over_is_renewed_with_its_token(ledger):
    """The post-takeover backlog: a new holder's long first pass starved its renewer past the TTL; the lease
    lapsed with no one else wanting it, renewal was refused, and every merge of the pass died at the fence.
    Nobody can have published under another token meanwhile, so the holder keeps its lease and its token."""
    _, S = ledger
    with S.begin() as s:
        runs_q.create_run(s, RUN, config_json="{}", code_version="t", git_commit=None, num_fragments=1, token_budget=1, now=T0)
    t = lambda sec: T0 + timedelta(seconds=sec)  # noqa: E731
    with S.begin() as s:
        assert sync_q.acquire_lease(s, RUN, "A", 2, t(0)) == 1
    publish(S, 0, holder="A", token=1, now=t(1))
    with S.begin() as s:
        assert sync_q.renew_lease(s, RUN, "A", 1, 2, t(5))  # lapsed at t(2), nobody took it: renewed until t(7)
    publish(S, 1, holder="A", token=1, now=t(6))  # the pass's merge lands
    with S.begin() as s:
        assert sync_q.acquire_lease(s, RUN, "A", 2, t(20)) == 1  # lapsed again: the same holder keeps its token
        assert sync_q.acquire_lease(s, RUN, "B", 2, t(21)) is None
        assert sync_q.acquire_lease(s, RUN, "B", 2, t(23)) == 2  # lapsed, and someone else wants it: a takeover
        assert not sync_q.renew_lease(s, RUN, "A", 1, 2, t(24))
    with pytest.raises(errors_q.LeaseLostError):
        publish(S, 2, holder="A", token=1, now=t(24))


def test_a_lease_whose_holder_held_its_presence_lock_is_taken_at_once_by_the_next_holder_of_that_lock(ledger):
    """``present``: the caller holds the shard's presence lock (ledger.presence). A holder that said it held it and
    lost it is gone: whoever holds it now takes over before the expiry, with a new token; the token still fences."""
    _, S = ledger
    with S.begin() as s:
        runs_q.create_run(s, RUN, config_json="{}", code_version="t", git_commit=None, num_fragments=1, token_budget=1, now=T0)
    t = lambda sec: T0 + timedelta(seconds=sec)  # noqa: E731

    def row():
        with S() as s:
            lease = sync_q.current_lease(s, RUN)
            return lease.holder, lease.token, lease.presence

    with S.begin() as s:
        assert sync_q.acquire_lease(s, RUN, "A", 3, t(0)) == 1  # without the lock (a hung holder had it)
        assert sync_q.acquire_lease(s, RUN, "B", 3, t(1), present=True) is None  # A never said it held it: not stolen
        assert sync_q.renew_lease(s, RUN, "A", 1, 3, t(1), present=True)  # A got the lock at a renewal
    assert row() == ("A", 1, True)
    with S.begin() as s:
        assert sync_q.acquire_lease(s, RUN, "B", 3, t(2)) is None  # live, and B has not the lock: A is alive
        assert sync_q.acquire_lease(s, RUN, "B", 3, t(2), present=True) == 2  # B has A's lock: A is gone
    assert row() == ("B", 2, True)
    with pytest.raises(errors_q.LeaseLostError):
        publish(S, 0, holder="A", token=1, now=t(2.5))  # the dead holder's writes, should any land, are fenced
    with S.begin() as s:
        assert not sync_q.renew_lease(s, RUN, "A", 1, 3, t(2.5), present=True)
        sync_q.release_lease(s, RUN, "B", 2, t(3))
    assert row() == ("B", 2, False)  # released: nothing to tell by a lock any more
    with S() as s:
        acquired = [e.detail for e in reversed(runs_q.events(s, RUN)) if e.kind == "lease_acquired"]
    assert acquired == ["token 1", "token 2; took over from A (its session ended)"]


# --- garbage collection -----------------------------------------------------------------------------


def test_versions_for_gc_keeps_newest_checkpoints_and_pending_bases(run):
    S = run
    for v in range(13):  # fragment 0: v0..v12
        publish(S, v)
    for v in range(3):  # fragment 1: v0..v2
        publish(S, v, fragment=1)
    with S.begin() as s:
        learner_q.register_learner(s, RUN, "us-0", "us", T0)
        learner_q.register_submission(s, RUN, "us-0", 0, sub("p", fragment=0, base=3), T0)  # pending on v3
        done, _ = learner_q.register_submission(s, RUN, "us-0", 0, sub("d", fragment=0, base=6), T0)
        sync_q.reject_submissions(s, RUN, [(done, "x")], holder="sync", token=1, now=T0)  # decided: does not pin v6
    with S() as s:
        gc = sorted((v.fragment, v.version) for v in sync_q.versions_for_gc(s, RUN, keep_last=3, checkpoint_every=5))
    # keep: newest 3 (10, 11, 12), every 5th (0, 5, 10), pending base 3; fragment 1 is all "newest".
    assert gc == [(0, 1), (0, 2), (0, 4), (0, 6), (0, 7), (0, 8), (0, 9)]
    with S.begin() as s:
        sync_q.mark_blobs_deleted(s, sync_q.versions_for_gc(s, RUN, keep_last=3, checkpoint_every=5), [])
    with S() as s:
        assert sync_q.versions_for_gc(s, RUN, keep_last=3, checkpoint_every=5) == []
        assert [x.id for x in sync_q.submissions_for_gc(s, RUN)] == [done]


# --- liveness ---------------------------------------------------------------------------------------

POLICY = liveness.LivenessPolicy(dead_after_s=10, straggler_factor=2.0)


def test_update_learner_statuses_dead_and_straggling(run):
    S = run
    with S.begin() as s:
        for lid in ("a", "b", "c", "d"):
            learner_q.register_learner(s, RUN, lid, "us", T0)
        for lid, st in (("a", 0.10), ("b", 0.12), ("c", 0.50), ("d", 0.10)):
            learner_q.record_heartbeat(s, RUN, lid, 0, now=T0, step=2, tokens=100, loss=1.0, tokens_per_s=1, step_time_s=st)
        # d's last heartbeat is rewritten to 30 s ago (no sleeping).
        s.execute(text("UPDATE learners SET last_heartbeat_at = :t WHERE id = 'd'"), {"t": T0 - timedelta(seconds=30)})
    now = T0 + timedelta(seconds=5)
    with S.begin() as s:
        verdicts = sync_q.update_learner_statuses(s, RUN, now, POLICY).learners
        assert liveness.live_ids(verdicts) == ["a", "b", "c"]
    with S.begin() as s:
        sync_q.update_learner_statuses(s, RUN, now, POLICY)  # a second pass declares nobody dead again
        status = {row.id: row.status for row in runs_q.learners(s, RUN)}
        assert status == {"a": "alive", "b": "alive", "c": "straggling", "d": "dead"}
        acct = reports_q.token_accounting(s, RUN)
        assert acct.lost == 100 and acct.in_flight == 300 and acct.balanced
        dead_events = [e for e in runs_q.events(s, RUN) if e.kind == "learner_dead"]
        assert len(dead_events) == 1 and dead_events[0].actor == "d"
    # Everyone falls silent, then d comes back with a heartbeat.
    later = T0 + timedelta(seconds=60)
    with S.begin() as s:
        assert liveness.live_ids(sync_q.update_learner_statuses(s, RUN, later, POLICY).learners) == []
        learner_q.record_heartbeat(s, RUN, "d", 0, now=later, step=3, tokens=150, loss=1.0, tokens_per_s=1, step_time_s=0.1)
    with S() as s:
        status = {row.id: row.status for row in runs_q.learners(s, RUN)}
        assert status == {"a": "dead", "b": "dead", "c": "dead", "d": "recovering"}
        assert liveness.live_ids(liveness.learner_verdicts(runs_q.learner_snapshots(runs_q.learners(s, RUN)), later, POLICY)) == ["d"]
        assert sorted(e.actor for e in runs_q.events(s, RUN) if e.kind == "learner_dead") == ["a", "b", "c", "d"]
        # a, b and c fell silent together (d had died 30 s before them): the region was cut off.
        cuts = [e.detail for e in runs_q.events(s, RUN) if e.kind == sync_q.REGION_CUT_OFF]
        assert len(cuts) == 1 and cuts[0].startswith("3 of 4 learners (the rest dead before) silent since 12:00:00 (1m 00s)")


def test_a_region_whose_learners_die_together_is_cut_off_once_by_the_pass_that_finds_it(run):
    S = run
    with S.begin() as s:
        for lid, region in (("eu-0", "eu"), ("eu-1", "eu"), ("us-0", "us")):
            learner_q.register_learner(s, RUN, lid, region, T0)
            learner_q.record_heartbeat(s, RUN, lid, 0, now=T0, step=2, tokens=100, loss=1.0, tokens_per_s=1, step_time_s=0.1)
    # eu goes silent; us heartbeats on.
    for now in (T0 + timedelta(seconds=11), T0 + timedelta(seconds=12)):
        with S.begin() as s:
            learner_q.record_heartbeat(s, RUN, "us-0", 0, now=now, step=3, tokens=150, loss=1.0, tokens_per_s=1, step_time_s=0.1)
            statuses = sync_q.update_learner_statuses(s, RUN, now, POLICY)
    assert statuses.regions["eu"].status == liveness.CUT_OFF and statuses.regions["us"].status == liveness.REGION_UP
    assert statuses.counts() == {"eu": {"alive": 0, "straggling": 0, "recovering": 0, "dead": 2},
                                 "us": {"alive": 1, "straggling": 0, "recovering": 0, "dead": 0}}
    with S() as s:
        cuts = [e for e in runs_q.events(s, RUN) if e.kind == sync_q.REGION_CUT_OFF]
    assert [(e.actor, e.at.replace(tzinfo=None)) for e in cuts] == [("eu", (T0 + timedelta(seconds=11)).replace(tzinfo=None))]
    assert cuts[0].detail.startswith("all 2 learners silent since")
    # eu-0 heartbeats again: the ledger says recovering at once, the region is up by the next pass.
    back = T0 + timedelta(seconds=20)
    with S.begin() as s:
        learner_q.record_heartbeat(s, RUN, "eu-0", 0, now=back, step=40, tokens=900, loss=1.0, tokens_per_s=1, step_time_s=0.1)
        assert {r.id: r.status for r in runs_q.learners(s, RUN)}["eu-0"] == liveness.RECOVERING
        statuses = sync_q.update_learner_statuses(s, RUN, back, POLICY)
    assert statuses.learners["eu-0"].status == liveness.ALIVE
    assert statuses.regions["eu"] == liveness.Verdict(liveness.REGION_UP, "1 of 2 learners live")


# --- upgrading a run's ledger in place -----------------------------------------------------------------


def test_a_ledger_written_before_the_heads_upgrades_in_place(ledger_url):
    """A run written at schema 0003 (no heads, no running totals) upgrades to head: its heads and totals are
    derived once, equal a full scan, and the run goes on (publish, exchange) from there."""
    from sqlalchemy import MetaData, Table

    from ddiloco.platform.invariants import read_snapshot, totals_problems
    from ddiloco.platform.ledger.engine import make_engine, upgrade

    engine = make_engine(ledger_url)
    try:
        upgrade(engine, "0003")
        with engine.begin() as conn:
            t = {name: Table(name, MetaData(), autoload_with=conn) for name in ("runs", "learners", "fragment_versions",
                                                                                  "submissions", "heartbeats", "synchronizer_leases")}
            conn.execute(t["runs"].insert(), dict(id=RUN, created_at=T0, status="running", config_json="{}", code_version="t",
                                                  num_fragments=2, token_budget=10**6))
            conn.execute(t["learners"].insert(), dict(
                run_id=RUN, id="us-0", region="us", status="alive", incarnation=0, started_at=T0, last_heartbeat_at=T0, step=9,
                tokens_per_s=1.0, step_time_s=1.0, tokens_trained=0, tokens_submitted=0, tokens_lost=0, inc_tokens_trained=400,
                inc_tokens_submitted=400, busy_s=9.0))
            conn.execute(t["synchronizer_leases"].insert(), dict(run_id=RUN, holder="sync", token=1, acquired_at=T0,
                                                                 expires_at=T0 + timedelta(hours=1)))
            published = {(0, 0): 0, (0, 1): 10, (0, 2): 40, (0, 3): 50, (1, 0): 0, (1, 1): 20}
            conn.execute(t["fragment_versions"].insert(), [
                dict(run_id=RUN, fragment=f, version=v, created_at=T0 + timedelta(seconds=s), blob_key=f"g/{f}/{v}", sha256="a" * 64,
                     nbytes=1, state_key=f"o/{f}/{v}", state_sha256="b" * 64, lease_token=1, synchronizer="sync",
                     blob_deleted=v == 0 and f == 0)
                for (f, v), s in published.items()
            ])
            fates = [(0, "merged", 1), (0, "merged", 2), (1, "merged", 1), (0, "rejected", None)]
            conn.execute(t["submissions"].insert(), [
                dict(run_id=RUN, learner_id="us-0", uid=f"u{i}", fragment=f, base_version=0, c_steps=1, c_tokens=100, tokens_new=100,
                     blob_key=f"s/{i}", sha256="c" * 64, nbytes=10 + i, codec="none", created_at=T0 + timedelta(seconds=i),
                     status=status, merged_version=v, reject_reason="stale" if status == "rejected" else None, blob_deleted=False)
                for i, (f, status, v) in enumerate(fates)
            ])
            conn.execute(t["heartbeats"].insert(), [
                dict(run_id=RUN, learner_id="us-0", incarnation=0, at=T0 + timedelta(seconds=i), step=i, tokens=100 * i, loss=3.0 - i,
                     tokens_per_s=1.0, step_time_s=1.0) for i in range(3)
            ])
        upgrade(engine)
        S = session_factory(engine)
        with S() as s:
            assert runs_q.latest_version_numbers(s, RUN) == {0: 3, 1: 1}
            assert runs_q.latest_versions(s, RUN)[0].blob_key == "g/0/3"
            want = reports_q.TokenAccounting(400, merged=300, rejected=100, pending=0, lost=0, in_flight=0)
            assert reports_q.token_accounting(s, RUN) == want
            snap = read_snapshot(s, RUN)
            assert totals_problems(snap.stored, snap.scanned) == []
            agg = reports_q.run_aggregates(s, RUN)
            assert agg.longest_merge_gap_s == 20.0 and agg.last_merged_at == T0 + timedelta(seconds=50)  # 20 -> 40
            assert (agg.submissions, agg.bytes_sent) == (4, 10 + 11 + 12 + 13)
            assert reports_q.rejected_totals(s, RUN) == [reports_q.RejectedTotal("us-0", "stale", 1, 100, 13)]  # filled by the upgrade
            assert runs_q.learners(s, RUN)[0].loss == 1.0
            assert runs_q.learners(s, RUN)[0].world_size is None  # registered before world sizes were recorded
            # Only the version GC had settled is out of its partial index.
            assert [(v.fragment, v.version) for v in sync_q.versions_for_gc(s, RUN, keep_last=1, checkpoint_every=100)] == [(0, 1), (0, 2)]
        publish(S, 4, merged=[], record=sync_q.MergeRecord(1, 1, 0, 0, 0, "after upgrade", {}))
        with S.begin() as s:
            beat = learner_q.Beat(10, 500, 0.5, 1.0, 1.0, model_flops_per_s=3.5e12, mfu=0.354)
            got = learner_q.learner_exchange(s, RUN, "us-0", 0, [sub("new")], beat, T0 + timedelta(seconds=60))
        assert got.current and got.heads[0].version == 4
        with S() as s:
            # A beat's FLOP/s and MFU reach the learner's row and its new heartbeat row; the older beats had none.
            assert (runs_q.learners(s, RUN)[0].model_flops_per_s, runs_q.learners(s, RUN)[0].mfu) == (3.5e12, 0.354)
            beats = s.execute(select(Heartbeat.step, Heartbeat.model_flops_per_s, Heartbeat.mfu).order_by(Heartbeat.step)).all()
            assert [tuple(b) for b in beats] == [(0, None, None), (1, None, None), (2, None, None), (10, 3.5e12, 0.354)]
        with S() as s:
            snap = read_snapshot(s, RUN)
            assert totals_problems(snap.stored, snap.scanned) == [] and snap.accounting.balanced
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_a_postgresql_ledger_connection_bounds_a_network_stall_unless_its_url_sets_its_own(postgres_url):
    """libpq gets platform.stall's keepalives and TCP_USER_TIMEOUT (the cut itself: tests/test_multiregion.py); a
    parameter the URL names keeps the URL's value."""
    from ddiloco.platform.ledger.engine import make_engine
    from ddiloco.platform.stall import STALL_TIMEOUT_S

    sep = "&" if "?" in postgres_url else "?"
    for url, user_timeout in ((postgres_url, int(STALL_TIMEOUT_S * 1000)), (f"{postgres_url}{sep}tcp_user_timeout=30000", 30000)):
        engine = make_engine(url)
        try:
            with engine.connect() as conn:
                params = conn.connection.dbapi_connection.info.get_parameters()
        finally:
            engine.dispose()
        assert params["tcp_user_timeout"] == str(user_timeout), params
        assert params["keepalives"] == "1" and int(params["keepalives_idle"]) <= STALL_TIMEOUT_S, params
        assert int(params["connect_timeout"]) <= STALL_TIMEOUT_S, params


@pytest.mark.postgres
def test_an_upgraded_long_run_leaves_gc_nothing_to_walk_on_postgresql(fresh_postgres_database):
    """A run at schema 0003 with 20,000 versions GC had already deleted upgrades to head with only its few
    unsettled versions in ``ix_fragment_versions_gc``: setting ``gc_done`` on every row in the upgrade left each
    row's old version in that partial index (built in the same transaction), and every GC pass walked them
    all until a VACUUM (#15)."""
    from sqlalchemy import text

    from ddiloco.platform.ledger.engine import make_engine, upgrade

    engine = make_engine(fresh_postgres_database)
    try:
        upgrade(engine, "0003")
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO runs (id, created_at, status, config_json, code_version, num_fragments, token_budget) "
                              "VALUES (:run, :t0, 'running', '{}', 't', 2, 1000000)"), {"run": RUN, "t0": T0})
            conn.execute(text(
                "INSERT INTO fragment_versions (run_id, fragment, version, created_at, blob_key, sha256, nbytes, state_key, "
                "state_sha256, lease_token, synchronizer, blob_deleted) "
                "SELECT :run, f, v, :t0 + make_interval(secs => v), 'g/' || f || '/' || v, repeat('a', 64), 1, "
                "'o/' || f || '/' || v, repeat('b', 64), 1, 'sync', v < 9997 "
                "FROM generate_series(0, 1) AS f, generate_series(0, 9999) AS v"), {"run": RUN, "t0": T0})
        upgrade(engine)
        with engine.connect() as conn:
            pages = conn.scalar(text("SELECT pg_relation_size('ix_fragment_versions_gc') / current_setting('block_size')::int"))
            assert conn.scalar(text("SELECT count(*) FROM fragment_versions WHERE gc_done <> blob_deleted")) == 0
        # 6 entries: one leaf page (and the metapage), not the 20,000 rows' old versions (~80 pages)
        assert pages <= 2, pages
        with session_factory(engine)() as s:
            assert [(v.fragment, v.version) for v in sync_q.versions_for_gc(s, RUN, keep_last=1, checkpoint_every=100_000)] == [
                (0, 9997), (0, 9998), (1, 9997), (1, 9998)]
    finally:
        engine.dispose()


BAD_ARGUMENTS = {
    "events limit -1": (lambda s: runs_q.events(s, RUN, limit=-1), "limit must be an integer from 0"),
    "norms limit -1": (lambda s: sync_q.recent_merged_norm_steps(s, RUN, 0, limit=-1), "limit must be"),
    "gc limit -1": (lambda s: sync_q.submissions_for_gc(s, RUN, limit=-1), "limit must be"),
    "gc keep_last 0": (lambda s: sync_q.versions_for_gc(s, RUN, 0, 50), "keep_last must be an integer from 1"),
    "gc checkpoint_every 0": (lambda s: sync_q.versions_for_gc(s, RUN, 3, 0), "checkpoint_every must be an integer from 1"),
    "lease ttl -1": (lambda s: sync_q.acquire_lease(s, RUN, "other", -1.0, T0), "lease ttl_s must be a finite number"),
    "lease ttl 2**40": (lambda s: sync_q.acquire_lease(s, RUN, "other", 2.0**40, T0), "lease ttl_s must be"),
    "lease ttl nan": (lambda s: sync_q.renew_lease(s, RUN, "sync", 1, float("nan"), T0), "lease ttl_s must be"),
    "lease shard -1": (lambda s: sync_q.acquire_lease(s, RUN, "other", 5.0, T0, shard=-1), "shard must be"),
    "lease shard 2**40": (lambda s: sync_q.acquire_lease(s, RUN, "other", 5.0, T0, shard=2**40), "shard must be"),
    "run of 0 fragments": (lambda s: runs_q.create_run(s, "r2", config_json="{}", code_version="t", git_commit=None, num_fragments=0,
                                                       token_budget=1, now=T0), "num_fragments must be an integer from 1"),
    "run budget -1": (lambda s: runs_q.create_run(s, "r2", config_json="{}", code_version="t", git_commit=None, num_fragments=1,
                                                  token_budget=-1, now=T0), "token_budget must be"),
    "version 2**40": (lambda s: runs_q.get_version(s, RUN, 0, 2**40), "version must be"),
    "pending of fragment 2**40": (lambda s: sync_q.pending_submissions(s, RUN, 2**40), "fragment must be"),
    "world 2**40": (lambda s: learner_q.register_learner(s, RUN, "x", "us", T0, world_size=2**40), "world_size must be"),
    "pid -1": (lambda s: learner_q.register_learner(s, RUN, "x", "us", T0, pid=-1), "pid must be"),
    "heartbeat step -1": (lambda s: learner_q.record_heartbeat(s, RUN, "us-0", 0, now=T0, step=-1, tokens=0, loss=None, tokens_per_s=0.0,
                                                               step_time_s=0.1), "step must be"),
    "heartbeat step_time_s -1": (lambda s: learner_q.record_heartbeat(s, RUN, "us-0", 0, now=T0, step=1, tokens=0, loss=None,
                                                                      tokens_per_s=0.0, step_time_s=-1.0), "step_time_s must be"),
    "beat tokens 2**70": (lambda s: learner_q.Beat(step=1, tokens=2**70, loss=None, tokens_per_s=1.0, step_time_s=0.1), "tokens must be"),
    "beat tokens_per_s inf": (lambda s: learner_q.Beat(step=1, tokens=1, loss=None, tokens_per_s=float("inf"), step_time_s=0.1),
                              "tokens_per_s must be"),
    "beat FLOP/s nan": (lambda s: learner_q.Beat(1, 1, None, 1.0, 0.1, model_flops_per_s=float("nan")),
                        "model_flops_per_s must be a finite number at least 0"),
    "beat FLOP/s 1e30": (lambda s: learner_q.Beat(1, 1, None, 1.0, 0.1, model_flops_per_s=1e30), "model_flops_per_s must be"),
    "beat MFU -0.1": (lambda s: learner_q.Beat(1, 1, None, 1.0, 0.1, mfu=-0.1), "mfu must be"),
    "beat MFU 'high'": (lambda s: learner_q.Beat(1, 1, None, 1.0, 0.1, mfu="high"), "mfu must be"),
}


def test_counts_no_caller_passes_are_one_named_ledger_error_and_write_nothing(run):
    # One ledger per backend for every case: each call in its own transaction, as a caller's would be.
    for case, (call, needle) in BAD_ARGUMENTS.items():
        with pytest.raises(errors_q.InvalidArgumentError, match=needle) as err, run.begin() as s:
            call(s)
        assert "\n" not in str(err.value), case
    with run() as s:
        assert runs_q.learners(s, RUN) == [] and [r.id for r in runs_q.list_runs(s)] == [RUN]
        assert runs_q.events(s, RUN, limit=0) == []  # zero is a count a caller may pass


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"c_steps": 2**31}, "c_steps=2147483648 does not fit the ledger's 32-bit column"),
        ({"fragment": 2**31}, "fragment=2147483648 does not fit"),
        ({"base_version": 2**40}, "base_version=1099511627776 does not fit"),
        ({"c_tokens": 2**63, "tokens_new": 1}, "c_tokens=9223372036854775808 does not fit the ledger's 64-bit column"),
        ({"nbytes": 2**64}, "nbytes=18446744073709551616 does not fit"),
        ({"tokens_total": 2**70}, "does not fit"),
        ({"tokens_total": -1}, "a count from 0"),
        ({"data_batches": -3}, "a count from 0"),
        ({"codec": "zstd"}, "codec 'zstd' is none of none, bf16, int8, int4"),
        ({"codec": "int8\x00"}, "is none of"),
    ],
)
def test_submissions_with_values_the_columns_or_the_platform_cannot_hold_are_refused_by_name(change, needle):
    fields = {**sub("u").__dict__, **change}
    with pytest.raises(ValueError, match="submission 'u': ") as err:
        learner_q.SubmissionIn(**fields)
    assert needle in str(err.value), str(err.value)
