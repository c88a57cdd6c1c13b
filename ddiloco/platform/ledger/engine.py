"""Engines and sessions for the ledger, and the Alembic upgrade that every entry point runs."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import SecretStr
from sqlalchemy import Connection, Engine, create_engine, event, inspect, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from ddiloco.platform import stall
from ddiloco.platform.config import ConfigError, ledger_url_problem
from ddiloco.platform.redact import redact_url

if TYPE_CHECKING:
    from alembic.config import Config

log = logging.getLogger("ddiloco.ledger")

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
SQLITE_BUSY_TIMEOUT_MS = 30_000
MIGRATION_LOCK_ID = 0x0DD1_10C0


def make_engine(url: str | SecretStr, *, read_only: bool = False, idle_in_transaction_timeout_s: float | None = None) -> Engine:
    """An engine for ``url`` (one that cannot be a ledger is a :class:`ConfigError` line); SQLite gets WAL, a busy
    timeout, foreign keys and write-locking transactions.

    ``read_only`` engines cannot write (SQLite ``query_only``, PostgreSQL read-only transactions) and
    read one snapshot per transaction, so figures read by several statements agree with each other.
    On PostgreSQL, ``idle_in_transaction_timeout_s`` makes the server end a session that sits in an
    open transaction that long: a process frozen mid-transaction (SIGSTOP, a VM pause) then
    releases its row locks instead of stalling every writer behind it."""
    if isinstance(url, SecretStr):  # the config's ledger URL
        url = url.get_secret_value()
    why = ledger_url_problem(url)
    if why:
        # Checked here too, not only when a config is loaded: --ledger options, the dashboard and flows pass URLs.
        raise ConfigError(f"ledger {redact_url(url)}: {why}")
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database
        if database and database != ":memory:" and not database.startswith("file:"):
            Path(database).parent.mkdir(parents=True, exist_ok=True)
        kwargs = {}
        if not database or database == ":memory:":
            from sqlalchemy.pool import StaticPool

            # One shared connection, so an in-memory ledger is one database for every session.
            kwargs = {"poolclass": StaticPool}
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}, **kwargs)
        _configure_sqlite(engine, read_only=read_only)
        return engine
    # A connection stalled by a network cut is dropped, not left to TCP's backoff (platform.stall).
    connect_args: dict = stall.libpq_params(parsed.query)
    if idle_in_transaction_timeout_s:
        connect_args["options"] = f"-c idle_in_transaction_session_timeout={int(idle_in_transaction_timeout_s * 1000)}"
    engine = create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=5, connect_args=connect_args)
    return _read_only_postgresql(engine) if read_only else engine


def _read_only_postgresql(engine: Engine) -> Engine:
    return engine.execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True)


def reader_of(engine: Engine) -> Engine:
    """A read-only engine on the ledger ``engine`` writes to (PostgreSQL shares its connection pool)."""
    url = engine.url
    if url.get_backend_name() == "postgresql":
        return _read_only_postgresql(engine)
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        return make_engine(url.render_as_string(hide_password=False), read_only=True)
    return engine  # in-memory SQLite: one shared connection, the only view of that database


def _configure_sqlite(engine: Engine, *, read_only: bool) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record) -> None:  # noqa: ANN001
        # Let SQLAlchemy, not pysqlite, decide where transactions begin (see the "begin" hook).
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        if read_only:
            cur.execute("PRAGMA query_only=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn) -> None:  # noqa: ANN001
        # Writers take the write lock up front: read-then-write transactions (lease, publish)
        # then serialise instead of failing with "database is locked" on upgrade.
        conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def alembic_config(url: str | None = None) -> Config:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if url:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def head_revision() -> str:
    """The newest migration's id, from the file names (``0010_lease_presence.py`` is revision ``0010``): the history is
    one numbered line, so this is what Alembic's head is, without loading Alembic and every migration to ask it."""
    return max(m.group(1) for f in (MIGRATIONS_DIR / "versions").glob("*.py") if (m := re.match(r"(\d{4})_", f.name)))


def current_revision(engine: Engine) -> str | None:
    """The ledger's recorded schema revision (None for a new ledger)."""
    with engine.connect() as conn:  # an unreachable ledger raises here, as the upgrade would
        try:
            found = conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
        except DBAPIError:  # no such table yet: a new ledger
            return None
    return found[0] if len(found) == 1 else None


def at_head(engine: Engine) -> bool:
    """Whether the ledger's recorded revision is the head already (False for a new ledger)."""
    return current_revision(engine) == head_revision()


@dataclass(frozen=True)
class RolesRenewal:
    """What an upgrade did for a PostgreSQL ledger's least-privilege roles (``ddiloco ledger roles``)."""

    prefix: str
    problem: str | None = None
    """Why their grants could not be renewed (the migration stands): None when they were."""


def upgrade(engine: Engine, revision: str = "head", *, replay: bool = False) -> RolesRenewal | None:
    """Bring the ledger schema to ``revision``. On a PostgreSQL ledger with least-privilege roles their grants are
    renewed in the same transaction, so that they cover the columns a migration added; returns what became of them
    (None: no roles, or nothing to migrate).

    A database without the ledger's tables is created at the head from the models and stamped, as Alembic's cookbook
    builds a database from scratch: the schema the migrations build (tests/test_ledger.py compares the two), for a
    fifth of the CPU of running every migration, which every new run's ledger and test paid. ``replay``: run every
    migration instead."""
    # Every process of a run opens the ledger; nearly always it is at the head, and asking Alembic costs each one
    # about 0.2 s of CPU (importing it and loading every migration), which a suite of hundreds of processes feels.
    if revision == "head" and at_head(engine):
        return None
    from alembic import command

    cfg = alembic_config()
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # Alembic loads and runs Python between statements, which a loaded machine can stretch past the
            # idle-in-transaction limit meant for dead learners: the server would end the migration half done.
            conn.exec_driver_sql("SET LOCAL idle_in_transaction_session_timeout = 0")
            # Processes starting together must not race to create the same tables.
            conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_ID})")
        cfg.attributes["connection"] = conn
        if revision == "head" and not replay and _new_ledger(conn):
            from ddiloco.platform.ledger.models import Base

            Base.metadata.create_all(conn)
            command.stamp(cfg, "head")
        else:
            command.upgrade(cfg, revision)
        if conn.dialect.name != "postgresql" or revision != "head":
            return None
        return _renew_roles(conn)


def _new_ledger(conn: Connection) -> bool:
    """Whether none of the ledger's tables (nor Alembic's record) is there yet; other applications' tables may be."""
    from ddiloco.platform.ledger.models import Base

    return not set(inspect(conn).get_table_names()) & {*Base.metadata.tables, "alembic_version"}


def _renew_roles(conn: Connection) -> RolesRenewal | None:
    """Column grants name their columns: without a renewal every learner's write of a column a migration added would
    be refused (permission denied) until someone ran ``ddiloco ledger roles`` again. A migrating role that may not
    renew them (no CREATEROLE, not the owner of the learners' function) keeps its migration, and is told so."""
    import ddiloco.platform.ledger.roles as roles

    prefix = roles.prefix_of(conn)
    if prefix is None:
        return None
    schema = conn.execute(text("SELECT current_schema()")).scalar_one()
    try:
        with conn.begin_nested():
            roles.apply(conn, roles.RolePlan(prefix, schema=schema))
    except (DBAPIError, conn.dialect.loaded_dbapi.Error) as err:
        problem = str(getattr(err, "orig", err)).splitlines()[0]
        log.warning("ledger migrated, but the roles %s_* were not granted what it added (%s): run `ddiloco ledger roles "
                    "--prefix %s` as a role that may", prefix, problem, prefix)
        return RolesRenewal(prefix, problem)
    return RolesRenewal(prefix)


def open_ledger(
    url: str | SecretStr, *, migrate: bool = True, read_only: bool = False, idle_in_transaction_timeout_s: float | None = None
) -> Engine:
    engine = make_engine(url, read_only=read_only, idle_in_transaction_timeout_s=idle_in_transaction_timeout_s)
    if migrate and not read_only:
        upgrade(engine)
    return engine
