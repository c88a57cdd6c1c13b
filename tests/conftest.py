"""Shared fixtures: ledgers on SQLite and PostgreSQL, fragment stores on file://, memory:// and s3:// (moto).

Fixture names are a contract other test files rely on: ``postgres_url``, ``ledger_url``,
``s3_endpoint``, ``store_url``.
"""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

# Set before anything imports prefect / streamlit: no telemetry from test runs.
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["DO_NOT_TRACK"] = "1"
os.environ["STREAMLIT_BROWSER_GATHER_USAGE_STATS"] = "false"

DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
PG_BIN = Path("/usr/lib/postgresql/15/bin")


# --- PostgreSQL -------------------------------------------------------------------------------------


def _pg_reachable(url: str) -> str | None:
    """None when ``url`` accepts a connection, else the reason it does not."""
    from sqlalchemy import create_engine, text

    try:
        engine = create_engine(url, connect_args={"connect_timeout": 3}, poolclass=_null_pool())
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        finally:
            engine.dispose()
    except Exception as err:  # noqa: BLE001 - any failure means "not usable"
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return None


def _null_pool():
    from sqlalchemy.pool import NullPool

    return NullPool


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_postgres(cmd: list[str]) -> list[str]:
    """initdb / pg_ctl refuse to run as root: run them as the postgres user when we are root."""
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *cmd]
    return cmd


def _start_throwaway_cluster() -> tuple[str | None, Path | None, str]:
    """Start a private PostgreSQL cluster; returns (url, data dir, reason if it failed)."""
    initdb, pg_ctl = PG_BIN / "initdb", PG_BIN / "pg_ctl"
    if not initdb.exists() or not pg_ctl.exists():
        return None, None, f"no PostgreSQL binaries at {PG_BIN}"
    if os.geteuid() == 0:
        try:
            pg_user = pwd.getpwnam("postgres")
        except KeyError:
            return None, None, "running as root and there is no 'postgres' user to run initdb as"
        if shutil.which("runuser") is None:
            return None, None, "running as root and runuser is not installed"
    base = Path(tempfile.mkdtemp(prefix="ddiloco-pg-"))
    data = base / "data"
    data.mkdir()
    if os.geteuid() == 0:
        for p in (base, data):
            os.chown(p, pg_user.pw_uid, pg_user.pw_gid)
    port = _free_port()
    try:
        subprocess.run(
            _as_postgres([str(initdb), "-D", str(data), "--auth=trust", "-U", "postgres"]),
            check=True, capture_output=True, timeout=120,
        )
        opts = f"-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={data} -c fsync=off"
        subprocess.run(
            _as_postgres([str(pg_ctl), "-D", str(data), "-o", opts, "-l", str(data / "server.log"), "-w", "start"]),
            check=True, capture_output=True, timeout=120,
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as err:
        detail = getattr(err, "stderr", b"") or b""
        shutil.rmtree(base, ignore_errors=True)
        return None, None, f"throwaway cluster failed: {err} {detail.decode(errors='replace')[-500:]}"
    url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    reason = _pg_reachable(url)
    if reason:
        _stop_cluster(data)
        return None, None, f"throwaway cluster started but refuses connections: {reason}"
    return url, data, ""


def _stop_cluster(data: Path) -> None:
    subprocess.run(
        _as_postgres([str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"]),
        capture_output=True, timeout=60,
    )
    shutil.rmtree(data.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_url():
    """A PostgreSQL server URL: $DDILOCO_TEST_POSTGRES_URL, the local server, or a throwaway cluster."""
    reasons = []
    env_url = os.environ.get("DDILOCO_TEST_POSTGRES_URL")
    if env_url:
        reason = _pg_reachable(env_url)
        if reason is None:
            yield env_url
            return
        reasons.append(f"DDILOCO_TEST_POSTGRES_URL={env_url}: {reason}")
    else:
        reason = _pg_reachable(DEFAULT_POSTGRES_URL)
        if reason is None:
            yield DEFAULT_POSTGRES_URL
            return
        reasons.append(f"{DEFAULT_POSTGRES_URL}: {reason}")
        url, data, why = _start_throwaway_cluster()
        if url is not None:
            try:
                yield url
            finally:
                _stop_cluster(data)
            return
        reasons.append(why)
    message = "!!! PostgreSQL tests NOT RUN — no usable server: " + " | ".join(reasons)
    if os.environ.get("DDILOCO_REQUIRE_POSTGRES") == "1":
        pytest.fail(message + " (DDILOCO_REQUIRE_POSTGRES=1)", pytrace=False)
    pytest.skip(message)


@pytest.fixture
def fresh_postgres_database(postgres_url):
    """A uniquely named, empty database on the postgres_url server, dropped after the test."""
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    name = f"ddiloco_test_{uuid.uuid4().hex}"
    admin = create_engine(postgres_url, isolation_level="AUTOCOMMIT", poolclass=_null_pool())
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        # Durability is not under test: skip the WAL flush at every commit (tests run ~3x faster).
        conn.exec_driver_sql(f'ALTER DATABASE "{name}" SET synchronous_commit = off')
    try:
        yield make_url(postgres_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


@pytest.fixture(
    params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)],
    ids=["sqlite", "postgres"],
)
def ledger_url(request, tmp_path):
    """An empty ledger URL of each backend; nothing is shared between tests."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/ledger.db"
    return request.getfixturevalue("fresh_postgres_database")


# --- object stores ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def s3_endpoint():
    """An in-process moto S3 server; the AWS_* env points plain s3fs / boto clients (and subprocesses) at it."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    os.environ["AWS_ENDPOINT_URL"] = url
    try:
        yield url
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(params=["file", "memory", "s3"])
def store_url(request, tmp_path):
    """A fresh, empty fragment-store root URL of each kind."""
    if request.param == "file":
        return f"file://{tmp_path}/store"
    if request.param == "memory":
        return f"memory://t-{uuid.uuid4().hex}"
    request.getfixturevalue("s3_endpoint")
    import s3fs

    bucket = f"b-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem().mkdir(bucket)
    return f"s3://{bucket}/root"


# --- collection -------------------------------------------------------------------------------------


def pytest_collection_modifyitems(config, items):
    # Any test parametrised with a "postgres" id needs the server, whichever fixture put it there.
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "postgres" in callspec.id.split("-"):
            item.add_marker(pytest.mark.postgres)
