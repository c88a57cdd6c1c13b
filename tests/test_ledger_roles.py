"""`ddiloco ledger roles` on the local PostgreSQL: each process's login role can do its work through the real query
functions, and nothing else (a learner writes only its own rows, the dashboard only reads)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import Engine, create_engine, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, InternalError, ProgrammingError
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool
from support import tiny_config
from typer.testing import CliRunner

from ddiloco.cli import app
from ddiloco.inprocess import SimClock, sim_learner, sim_step
from ddiloco.platform.invariants import check_run
from ddiloco.platform.ledger import learner as learner_q
from ddiloco.platform.ledger import open_ledger, session_factory
from ddiloco.platform.ledger import reports as reports_q
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger import synchronizer as sync_q
from ddiloco.platform.ledger.models import REJECTED, Submission
from ddiloco.platform.ledger.roles import grants
from ddiloco.platform.runtime import RunContext
from ddiloco.synchronizer.evaluation import evaluate_and_record
from ddiloco.synchronizer.gc import collect_garbage
from ddiloco.synchronizer.service import Synchronizer
from ddiloco.ui import queries as uq

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
PASSWORD = "pw-" + uuid.uuid4().hex
"""A password only this test knows: it must reach no output, and the server keeps only its SCRAM verifier."""


@dataclass
class Ledger:
    admin: str
    prefix: str

    def url(self, role: str) -> str:
        return make_url(self.admin).set(username=role, password=None).render_as_string(hide_password=False)

    def login(self, kind: str) -> str:
        return self.url(f"{self.prefix}_{kind}_login")

    def learner(self, learner_id: str) -> str:
        return self.url(f"{self.prefix}_learner_{learner_id}")


def roles_command(ledger: str, prefix: str, *extra: str, env: dict[str, str] | None = None):  # noqa: ANN201 - click Result
    return CliRunner().invoke(app, ["ledger", "roles", "--ledger", ledger, "--prefix", prefix, *extra], env=env)


def _drop_roles(server: str, prefix: str) -> None:
    admin = create_engine(server, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        with admin.connect() as conn:
            names = conn.execute(text("SELECT rolname FROM pg_roles WHERE starts_with(rolname, :p)"), {"p": f"{prefix}_"}).scalars()
            for name in sorted(names, key=len, reverse=True):  # login roles before their groups
                conn.exec_driver_sql(f'DROP ROLE "{name}"')
    finally:
        admin.dispose()


@pytest.fixture(scope="module")
def ledger(postgres_url: str) -> Iterator[Ledger]:
    """A migrated scratch ledger with the roles of a unique prefix: learners us-0 and us-1, and a login role per group.
    Roles are cluster-wide: they are dropped after the database."""
    from ddiloco.testing.postgres import scratch_database

    prefix = f"t{uuid.uuid4().hex[:8]}"
    try:
        with scratch_database(postgres_url) as url:
            open_ledger(url).dispose()
            logins = [f"--login={kind}={prefix}_{kind}_login" for kind in ("synchronizer", "evaluator", "dashboard")]
            result = roles_command(url, prefix, "--learner", "us-0", "--learner", "us-1", *logins, "--password-env", "ROLES_PW",
                                   env={"ROLES_PW": PASSWORD})
            assert result.exit_code == 0, result.output
            assert PASSWORD not in result.output
            yield Ledger(url, prefix)
    finally:
        _drop_roles(postgres_url, prefix)


def _engine(url: str) -> Engine:
    return create_engine(url, poolclass=NullPool)


def refused(engine: Engine, sql: str, params: dict | None = None) -> str:
    """Run ``sql`` in its own transaction; the database's refusal (the test fails when it is allowed)."""
    with pytest.raises(DBAPIError) as err, engine.begin() as conn:
        conn.execute(text(sql), params or {})
    return str(err.value.orig)


def config(ledger: Ledger):  # noqa: ANN201 - RunConfig
    return tiny_config(
        name=f"r{uuid.uuid4().hex[:6]}", ledger={"url": ledger.admin}, storage={"url": f"memory://roles-{uuid.uuid4().hex[:8]}"},
        quorum={"min_count": 1}, grace={"enabled": False}, synchronizer={"retention": {"keep_last": 1, "checkpoint_every": 1000}},
    )


# --- the command -------------------------------------------------------------------------------------------------


def test_sqlite_has_no_roles(tmp_path):
    result = roles_command(f"sqlite:///{tmp_path}/ledger.db", "ddiloco")
    assert result.exit_code == 2
    assert "needs a PostgreSQL ledger" in result.output and len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["--prefix", "Bad-Prefix"], {}, "role prefix 'Bad-Prefix' is not valid"),
        (["--learner", "../x"], {}, "is not a valid id"),
        (["--learner", "x" * 60], {}, "longer than PostgreSQL's 63 characters"),
        (["--login", "learner=x"], {}, "login kind 'learner' is not one of"),
        (["--login", "dashboard"], {}, "write KIND=NAME"),
        (["--learner", "a", "--password-env", "NO_SUCH_VAR_HERE"], {}, "NO_SUCH_VAR_HERE: that environment variable is not set"),
        (["--password-env", "PW"], {"PW": "x"}, "name them with --learner or --login"),
    ],
)
def test_bad_arguments_are_one_line_errors(args, env, message):
    # Refused before any connection: the server named does not exist.
    result = CliRunner().invoke(app, ["ledger", "roles", "--ledger", "postgresql+psycopg://u@127.0.0.1:1/none", *args], env=env)
    assert result.exit_code == 2 and message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1


def _grants_and_policies(url: str, prefix: str) -> tuple[list, list]:
    engine = _engine(url)
    try:
        with engine.connect() as conn:
            table_grants = conn.execute(text(
                "SELECT grantee, table_name, privilege_type FROM information_schema.role_table_grants "
                "WHERE starts_with(grantee, :p) ORDER BY 1, 2, 3"), {"p": prefix}).all()
            column_grants = conn.execute(text(
                "SELECT grantee, table_name, column_name, privilege_type FROM information_schema.column_privileges "
                "WHERE starts_with(grantee, :p) ORDER BY 1, 2, 3, 4"), {"p": prefix}).all()
            policies = conn.execute(text(
                "SELECT tablename, policyname, roles::text, cmd, qual, with_check FROM pg_policies ORDER BY 1, 2")).all()
        return table_grants + column_grants, policies
    finally:
        engine.dispose()


def test_running_again_changes_nothing(ledger):
    before = _grants_and_policies(ledger.admin, ledger.prefix)
    again = roles_command(ledger.admin, ledger.prefix, "--learner", "us-0")
    assert again.exit_code == 0, again.output
    assert _grants_and_policies(ledger.admin, ledger.prefix) == before


def test_a_second_prefix_on_the_same_ledger_is_refused_whole(ledger):
    other = f"t{uuid.uuid4().hex[:8]}"
    try:
        result = roles_command(ledger.admin, other, "--learner", "us-0")
        assert result.exit_code == 2, result.output
        assert f"set up with another prefix (its function belongs to {ledger.prefix}_synchronizer)" in result.output
        assert len(result.output.strip().splitlines()) == 1
        with _engine(ledger.admin).connect() as conn:  # one transaction: not even its roles were created
            assert conn.execute(text("SELECT count(*) FROM pg_roles WHERE starts_with(rolname, :p)"), {"p": other}).scalar() == 0
    finally:
        _drop_roles(ledger.admin, other)


def test_dry_run_prints_the_sql_and_creates_nothing(ledger):
    other = f"t{uuid.uuid4().hex[:8]}"
    shown = roles_command(ledger.admin, other, "--learner", "us-9", "--password-env", "PW", "--dry-run", env={"PW": PASSWORD})
    assert shown.exit_code == 0, shown.output
    assert f'CREATE ROLE "{other}_learner_us-9" LOGIN' in shown.output
    assert f"ALTER ROLE \"{other}_learner_us-9\" PASSWORD '***';" in shown.output and PASSWORD not in shown.output
    assert "ENABLE ROW LEVEL SECURITY" in shown.output and "SECURITY DEFINER" in shown.output
    with _engine(ledger.admin).connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM pg_roles WHERE starts_with(rolname, :p)"), {"p": other}).scalar() == 0


def test_an_upgrade_grants_the_roles_the_columns_it_adds(postgres_url):
    """Roles set up at one schema, then a migration adds columns a learner writes (0011: its FLOP/s and MFU):
    `ddiloco ledger upgrade` renews the grants in its own transaction, so the learner's next beat is not refused."""
    from alembic import command

    from ddiloco.platform.ledger.engine import alembic_config
    from ddiloco.testing.postgres import scratch_database

    prefix = f"t{uuid.uuid4().hex[:8]}"
    try:
        with scratch_database(postgres_url) as url:
            open_ledger(url).dispose()
            assert roles_command(url, prefix, "--learner", "us-0").exit_code == 0
            ledger = Ledger(url, prefix)
            run = f"r{uuid.uuid4().hex[:6]}"
            admin = _engine(url)
            with admin.begin() as conn:  # the roles as they were before 0011: its columns, and their grants, gone
                cfg = alembic_config()
                cfg.attributes["connection"] = conn
                command.downgrade(cfg, "0010")
            before = _grants_and_policies(url, prefix)
            assert not [g for g in before[0] if len(g) == 4 and g[2] in ("model_flops_per_s", "mfu")]
            result = CliRunner().invoke(app, ["ledger", "upgrade", "--ledger", url])
            assert result.exit_code == 0, result.output
            assert f"the roles {prefix}_* were granted what it added" in " ".join(result.output.split())
            after = _grants_and_policies(url, prefix)
            added = {(g[0], g[1], g[2], g[3]) for g in after[0] if len(g) == 4} - {tuple(g) for g in before[0] if len(g) == 4}
            assert {(f"{prefix}_learner", t, c, "UPDATE" if t == "learners" else "INSERT")
                    for t in ("learners", "heartbeats") for c in ("model_flops_per_s", "mfu")} <= added
            with session_factory(admin).begin() as s:
                runs_q.create_run(s, run, config_json="{}", code_version="t", git_commit=None, num_fragments=1,
                                  token_budget=1000, now=T0)
            learner = _engine(ledger.learner("us-0"))
            try:
                with session_factory(learner).begin() as s:
                    assert learner_q.register_learner(s, run, "us-0", "us", T0) == 0
                    beat = learner_q.Beat(5, 100, 2.0, 10.0, 0.1, model_flops_per_s=4.2e14, mfu=0.42)
                    assert learner_q.learner_exchange(s, run, "us-0", 0, [], beat, T0 + timedelta(seconds=1)).current
                with session_factory(learner)() as s:
                    assert [(r.model_flops_per_s, r.mfu) for r in runs_q.learners(s, run)] == [(4.2e14, 0.42)]
            finally:
                learner.dispose()
                admin.dispose()
            # A ledger already at the head is left alone: no grant is renewed, and nothing is said of roles.
            again = CliRunner().invoke(app, ["ledger", "upgrade", "--ledger", url])
            assert again.exit_code == 0 and "roles" not in again.output, again.output
    finally:
        _drop_roles(postgres_url, prefix)


def test_an_upgrade_by_an_owner_who_may_not_renew_the_roles_keeps_its_migration_and_says_what_to_run(postgres_url):
    """The tables' owner migrates but may not alter roles (no CREATEROLE) nor replace the synchronizer's function: the
    migration commits, the renewal rolls back to its savepoint, and the command names the one to run (exit 2)."""
    from alembic import command

    from ddiloco.platform.ledger.engine import alembic_config, at_head
    from ddiloco.testing.postgres import scratch_database

    prefix = f"t{uuid.uuid4().hex[:8]}"
    owner = f"{prefix}_owner"
    try:
        with scratch_database(postgres_url) as url:
            open_ledger(url).dispose()
            assert roles_command(url, prefix, "--learner", "us-0").exit_code == 0
            admin = _engine(url)
            try:
                with admin.begin() as conn:
                    cfg = alembic_config()
                    cfg.attributes["connection"] = conn
                    command.downgrade(cfg, "0010")
                    conn.exec_driver_sql(f'CREATE ROLE "{owner}" LOGIN NOCREATEROLE')
                    for table in ("learners", "heartbeats", "alembic_version"):
                        conn.exec_driver_sql(f'ALTER TABLE {table} OWNER TO "{owner}"')
                before = _grants_and_policies(url, prefix)
            finally:
                admin.dispose()
            as_owner = make_url(url).set(username=owner, password=None).render_as_string(hide_password=False)
            result = CliRunner().invoke(app, ["ledger", "upgrade", "--ledger", as_owner])
            said = " ".join(result.output.split())
            assert result.exit_code == 2, result.output
            assert f"the roles {prefix}_* were not granted what the upgrade added (" in said
            assert f"run `ddiloco ledger roles --prefix {prefix}` as a role that may" in said
            engine = _engine(url)
            try:
                assert at_head(engine)  # the migration stands
            finally:
                engine.dispose()
            # No grant or policy changed half-way: the groups' only grants on the new columns are what their table-wide
            # SELECTs give any column (the owner has every privilege on its tables).
            new_columns = ("model_flops_per_s", "mfu")
            grants_after, policies_after = _grants_and_policies(url, prefix)
            assert policies_after == before[1]
            assert [g for g in grants_after if len(g) != 4 or g[2] not in new_columns] == before[0]
            assert {g[3] for g in grants_after if len(g) == 4 and g[2] in new_columns and g[0] != owner} == {"SELECT"}
    finally:
        _drop_roles(postgres_url, prefix)


def test_login_passwords_are_stored_as_scram_verifiers_only(ledger):
    engine = _engine(ledger.admin)
    try:
        with engine.connect() as conn:
            stored = dict(conn.execute(text("SELECT rolname, rolpassword FROM pg_authid WHERE starts_with(rolname, :p)"),
                                       {"p": ledger.prefix}).all())
            settings = conn.execute(text("SELECT rolconfig FROM pg_roles WHERE rolname = :r"),
                                    {"r": f"{ledger.prefix}_dashboard_login"}).scalar()
    finally:
        engine.dispose()
    logins = [f"{ledger.prefix}_learner_us-0", f"{ledger.prefix}_learner_us-1",
              *(f"{ledger.prefix}_{kind}_login" for kind in ("synchronizer", "evaluator", "dashboard"))]
    assert all(stored[name].startswith("SCRAM-SHA-256$") and PASSWORD not in stored[name] for name in logins)
    assert all(stored[f"{ledger.prefix}_{group}"] is None for group in ("synchronizer", "evaluator", "dashboard", "learner"))
    assert settings == ["default_transaction_read_only=on"]


# --- every role at work, through the real code ---------------------------------------------------------------------


def test_each_role_does_its_whole_job_through_the_real_code(ledger):
    """Learners us-0 and us-1 train and send through their own login roles; the synchronizer's role merges, publishes
    and collects garbage; the evaluator's records an evaluation; the dashboard's reads every page — and the run holds
    every invariant afterwards."""
    cfg = config(ledger)
    clock = SimClock()
    engines = []

    def context(url: str) -> RunContext:
        engines.append(open_ledger(url))
        return RunContext(cfg=cfg, run_id=cfg.name, engine=engines[-1], clock=clock)

    try:
        sync_ctx = context(ledger.login("synchronizer"))
        sync = Synchronizer(sync_ctx, holder="sync")
        sync.poll_once(clock.t)
        learners = [sim_learner(context(ledger.learner(lid)), lid) for lid in ("us-0", "us-1")]
        for learner in learners:
            learner.start(clock.t)
        for _ in range(3 * cfg.fragments.count):
            clock.t += 1.0
            for learner in learners:
                sim_step(learner, clock.t)
            sync.poll_once(clock.t)
        for learner in learners:  # a saved optimizer state is the learner's own row too
            learner.save_state()
            learner.finish_saves()
        assert max(st.version for st in sync.state.values()) >= 2
        assert sum(collect_garbage(sync_ctx)) > 0
        evaluate_and_record(context(ledger.login("evaluator")), clock.t)
        # With its budget merged, the synchronizer's own loop ends the run through its role, drains it and returns
        # (a guard stops the loop after two minutes if it never does: the run would then still be running).
        with context(ledger.admin).transaction() as s:
            s.execute(text("UPDATE runs SET token_budget = 1 WHERE id = :run"), {"run": cfg.name})
        guard = threading.Event()
        timer = threading.Timer(120.0, guard.set)
        timer.start()
        try:
            sync.run(guard)
        finally:
            timer.cancel()
        with sync_ctx.reading() as s:
            assert runs_q.require_run(s, cfg.name).status == runs_q.FINISHED

        dashboard = uq.read_only_engine(ledger.login("dashboard"))
        engines.append(dashboard)
        uq.check_schema(dashboard)
        with Session(dashboard) as s:
            page = uq.run_page(s, cfg.name, datetime.fromtimestamp(clock.t, timezone.utc))
            assert page is not None and set(page.learners["learner"]) == {"us-0", "us-1"} and len(page.evaluations) == 1
            assert cfg.name in set(uq.runs_overview(s, page.now)["run"])

        owner = RunContext(cfg=cfg, run_id=cfg.name, engine=open_ledger(ledger.admin), clock=clock)
        engines.append(owner.engine)
        assert check_run(owner) == []
        with owner.reading() as s:
            assert reports_q.token_accounting(s, cfg.name).merged > 0
    finally:
        for engine in engines:
            engine.dispose()


def _run_with_learners(ledger: Ledger) -> str:
    """A run with version 0 of one fragment, learner us-1 registered and one pending submission of us-1."""
    run = f"r{uuid.uuid4().hex[:6]}"
    S = session_factory(open_ledger(ledger.admin))
    blob = sync_q.BlobRef(f"{run}/global/f0/v0.safetensors", "a" * 64, 1)
    with S.begin() as s:
        runs_q.create_run(s, run, config_json="{}", code_version="t", git_commit=None, num_fragments=1, token_budget=10**6, now=T0)
        token = sync_q.acquire_lease(s, run, "sync", 3600, T0)
        sync_q.publish_version(s, run, 0, 0, blob=blob, state=blob, holder="sync", token=token, now=T0)
        learner_q.register_learner(s, run, "us-1", "us", T0)
        learner_q.register_submission(s, run, "us-1", 0, _sub("b1"), T0)
    S.kw["bind"].dispose()
    return run


def _sub(uid: str, tokens: int = 100) -> learner_q.SubmissionIn:
    return learner_q.SubmissionIn(uid, 0, 0, 4, tokens, tokens, tokens, f"k-{uid}", "c" * 64, 10, "none")


def test_a_learner_writes_only_its_own_rows(ledger):
    run = _run_with_learners(ledger)
    engine = _engine(ledger.learner("us-0"))
    S = session_factory(engine)
    try:
        # Its own work goes through the real learner queries.
        with S.begin() as s:
            assert learner_q.register_learner(s, run, "us-0", "us", T0) == 0
            beat = learner_q.Beat(5, 100, 2.0, 10.0, 0.1)
            got = learner_q.learner_exchange(s, run, "us-0", 0, [_sub("a1")], beat, T0 + timedelta(seconds=1))
            assert got.current and got.registered[0][1] and got.heads[0].version == 0
            assert learner_q.record_heartbeat(s, run, "us-0", 0, now=T0, step=6, tokens=120, loss=1.9, tokens_per_s=1.0, step_time_s=0.1)
            assert learner_q.set_optimizer_state(s, run, "us-0", f"{run}/learners/us-0/o", "d" * 64) is None
        with S() as s:  # and it sees no one else's rows
            assert [r.id for r in runs_q.learners(s, run)] == ["us-0"]
            assert {p.learner_id for p in sync_q.pending_submissions(s, run)} == {"us-0"}

        # Another learner's rows: refused, or invisible to an update.
        other = {"run": run, "t": T0}
        assert "row-level security" in refused(
            engine, "INSERT INTO heartbeats (run_id, learner_id, incarnation, at, step, tokens, tokens_per_s, step_time_s) "
            "VALUES (:run, 'us-1', 0, :t, 1, 1, 1, 1)", other)
        with pytest.raises(ProgrammingError, match="row-level security"), S.begin() as s:
            learner_q.register_submission(s, run, "us-1", 0, _sub("forged"), T0)
        with pytest.raises(ProgrammingError, match="row-level security"), S.begin() as s:
            learner_q.register_learner(s, run, "us-9", "us", T0)
        assert "row-level security" in refused(
            engine, "INSERT INTO events (run_id, at, kind, actor, detail) VALUES (:run, :t, 'learner_joined', 'us-1', '')", other)
        with engine.begin() as conn:
            assert conn.execute(text("UPDATE learners SET step = 999 WHERE run_id = :run AND id = 'us-1'"), other).rowcount == 0
        with pytest.raises(ProgrammingError, match="row-level security"), S.begin() as s:
            learner_q.record_heartbeat(s, run, "us-1", 0, now=T0, step=7, tokens=1, loss=None, tokens_per_s=1, step_time_s=1)
        # Its own submission only as a pending one, and never an id of its choosing (the sequence is everyone's).
        assert "row-level security" in refused(
            engine, "INSERT INTO submissions (run_id, learner_id, uid, fragment, base_version, c_steps, c_tokens, tokens_new, "
            "blob_key, sha256, nbytes, codec, created_at, status, blob_deleted) "
            "VALUES (:run, 'us-0', 'm', 0, 0, 1, 1, 1, 'k', 'x', 1, 'none', :t, 'merged', false)", other)
        assert "permission denied" in refused(
            engine, "INSERT INTO heartbeats (id, run_id, learner_id, incarnation, at, step, tokens, tokens_per_s, step_time_s) "
            "VALUES (10000000, :run, 'us-0', 0, :t, 1, 1, 1, 1)", other)

        # Fates, versions, leases and the run are the synchronizer's; nobody deletes.
        for sql in (
            "UPDATE submissions SET status = 'merged' WHERE run_id = :run AND learner_id = 'us-0'",
            "UPDATE submissions SET merged_version = 1, weight = 1 WHERE run_id = :run AND learner_id = 'us-0'",
            "UPDATE submissions SET status = 'rejected', reject_reason = 'x' WHERE run_id = :run AND learner_id = 'us-1'",
            "UPDATE runs SET tokens_rejected = 0, status = 'finished' WHERE id = :run",
            "UPDATE fragment_heads SET version = 5 WHERE run_id = :run",
            "INSERT INTO fragment_versions (run_id, fragment, version, created_at, blob_key, sha256, nbytes, state_key, "
            "state_sha256, lease_token, synchronizer, blob_deleted, gc_done) "
            "VALUES (:run, 0, 1, :t, 'k', 'x', 1, 'k', 'x', 1, 'us-0', false, false)",
            "INSERT INTO merges (run_id, fragment, version, at, quorum, live_learners, included, rejected, grace_window_s, "
            "grace_waited_s, merge_s, reason, detail_json) VALUES (:run, 0, 1, :t, 1, 1, 1, 0, 0, 0, 0, 'x', '{}')",
            "UPDATE synchronizer_leases SET holder = 'us-0', token = token + 1 WHERE run_id = :run",
            "INSERT INTO evaluations (run_id, at, tokens, versions_total, val_loss) VALUES (:run, :t, 1, 1, 1.0)",
            "INSERT INTO runs (id, created_at, status, config_json, code_version, num_fragments, token_budget) "
            "VALUES ('mine', :t, 'running', '{}', 'x', 1, 1)",
            *(f"DELETE FROM {table}" for table in grants()["dashboard"]),
        ):
            assert "permission denied" in refused(engine, sql, other), sql
        with pytest.raises(ProgrammingError, match="permission denied"), S.begin() as s:
            sync_q.acquire_lease(s, run, "us-0", 3600, T0 + timedelta(days=1))
        with pytest.raises(ProgrammingError, match="permission denied"), S.begin() as s:
            sync_q.reject_submissions(s, run, [(1, "x")], holder="us-0", token=1, now=T0)

        # The rejection function: only for the caller's own identity, and only for a superseded incarnation.
        function = f"SELECT {learner_q.REJECT_SUPERSEDED}(:run, :who, 0, ARRAY[:id]::bigint[], 'x', :t)"
        with S() as s:
            mine = s.scalars(select(Submission.id).where(Submission.run_id == run, Submission.learner_id == "us-0")).one()
        assert "may not reject submissions of learner us-1" in refused(engine, function, {**other, "who": "us-1", "id": mine})
        assert "is current, not superseded" in refused(engine, function, {**other, "who": "us-0", "id": mine})
    finally:
        engine.dispose()


def test_a_superseded_learner_role_rejects_its_own_work_with_the_accounting_kept(ledger):
    """A paused incarnation wakes after its replacement registered: its submission is rejected by the synchronizer
    role's function, with the run's totals, the learner's accounting and the event exactly as the owner's path keeps them."""
    run = _run_with_learners(ledger)
    engine = open_ledger(ledger.learner("us-0"))
    S = session_factory(engine)
    admin = open_ledger(ledger.admin)
    try:
        with S.begin() as s:
            learner_q.register_learner(s, run, "us-0", "us", T0)
            learner_q.record_heartbeat(s, run, "us-0", 0, now=T0, step=3, tokens=300, loss=1.0, tokens_per_s=1, step_time_s=1)
            assert learner_q.register_learner(s, run, "us-0", "us", T0) == 1  # its replacement: 300 tokens counted as lost
        with S.begin() as s:
            late = learner_q.learner_exchange(s, run, "us-0", 0, [_sub("late", 100)], learner_q.Beat(4, 400, 1.0, 1.0, 1.0), T0)
        assert not late.current
        with session_factory(admin)() as s:
            row = s.get(Submission, late.registered[0][0])
            assert row.status == REJECTED and row.reject_reason == "superseded incarnation 0 (current 1)"
            acct = reports_q.token_accounting(s, run)
            assert (acct.rejected, acct.lost, acct.pending) == (100, 200, 100) and acct.balanced
            assert reports_q.scanned_tokens(s, run)[REJECTED] == reports_q.decided_tokens(s, run)[REJECTED]
            assert [t for t in reports_q.rejected_totals(s, run) if t.learner_id == "us-0"] == [
                reports_q.RejectedTotal("us-0", "superseded incarnation", 1, 100, row.nbytes)]
            assert any(e.kind == "submission_rejected" and e.actor == "us-0" for e in runs_q.events(s, run))
    finally:
        engine.dispose()
        admin.dispose()


def test_the_dashboard_role_reads_and_cannot_write(ledger):
    run = _run_with_learners(ledger)
    engine = _engine(ledger.login("dashboard"))
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SHOW default_transaction_read_only")).scalar() == "on"
            assert conn.execute(text("SELECT count(*) FROM submissions WHERE run_id = :run"), {"run": run}).scalar() == 1
        with Session(engine) as s:
            assert uq.run_page(s, run, T0) is not None
        # Even a read-write transaction asked for explicitly has no privilege to write.
        for sql in ("INSERT INTO events (run_id, at, kind, actor, detail) VALUES (:run, :t, 'x', NULL, '')",
                    "UPDATE runs SET status = 'finished' WHERE id = :run", "DELETE FROM heartbeats"):
            with pytest.raises((ProgrammingError, InternalError)), engine.begin() as conn:
                conn.execute(text("SET TRANSACTION READ WRITE"))
                conn.execute(text(sql), {"run": run, "t": T0})
        assert "read-only transaction" in refused(engine, "UPDATE runs SET status = 'x' WHERE id = :run", {"run": run})
    finally:
        engine.dispose()
