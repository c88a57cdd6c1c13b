"""PostgreSQL for tests and benchmarks: which server, is it usable, a scratch database on it, and a
throwaway cluster when there is no server at all."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ddiloco.testing.net import free_port

DEFAULT_SERVER_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
SERVER_URL_ENV = "DDILOCO_TEST_POSTGRES_URL"
# Debian's layout; initdb and pg_ctl are not on PATH there.
DEBIAN_PG_ROOT = Path("/usr/lib/postgresql")


def server_url() -> str:
    """The server tests and benchmarks create their databases on: $DDILOCO_TEST_POSTGRES_URL or the local one."""
    return os.environ.get(SERVER_URL_ENV) or DEFAULT_SERVER_URL


def unreachable(url: str) -> str | None:
    """None when ``url`` accepts a connection, else the reason it does not."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    try:
        engine = create_engine(url, connect_args={"connect_timeout": 3}, poolclass=NullPool)
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        finally:
            engine.dispose()
    except Exception as err:  # noqa: BLE001 - any failure means "not usable"
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return None


@contextmanager
def scratch_database(server: str, prefix: str = "ddiloco_test", *, durable: bool = False) -> Iterator[str]:
    """A new, empty database on ``server`` (its URL, password kept), dropped on exit even if clients are still connected.

    Unless ``durable``, commits do not wait for the WAL flush: durability is not what tests measure."""
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url
    from sqlalchemy.pool import NullPool

    name = f"{prefix}_{uuid.uuid4().hex[:16]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
            if not durable:
                conn.exec_driver_sql(f'ALTER DATABASE "{name}" SET synchronous_commit = off')
        try:
            yield make_url(server).set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as conn:
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.dispose()


# --- a throwaway cluster ------------------------------------------------------------------------------


def _bin_dir() -> Path | None:
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    versions = sorted(DEBIAN_PG_ROOT.glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]) if p.parts[-3].isdigit() else 0)
    return versions[-1].parent if versions else None


def _as_postgres(cmd: list[str]) -> list[str]:
    """initdb / pg_ctl refuse to run as root: run them as the postgres user when we are root."""
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *cmd]
    return cmd


@dataclass
class ThrowawayCluster:
    """A private PostgreSQL cluster in a temporary folder, for machines without a server."""

    url: str
    data: Path
    bin_dir: Path
    options: str = ""
    """The server's command-line options (port, socket folder), as :meth:`resume` starts it again."""

    @classmethod
    def start(cls) -> ThrowawayCluster:
        """Start one, or raise RuntimeError saying why it cannot be had."""
        bin_dir = _bin_dir()
        if bin_dir is None:
            raise RuntimeError(f"no initdb on PATH or under {DEBIAN_PG_ROOT}")
        pg_user = None
        if os.geteuid() == 0:
            try:
                pg_user = pwd.getpwnam("postgres")
            except KeyError:
                raise RuntimeError("running as root and there is no 'postgres' user to run initdb as") from None
            if shutil.which("runuser") is None:
                raise RuntimeError("running as root and runuser is not installed")
        base = Path(tempfile.mkdtemp(prefix="ddiloco-pg-"))
        data = base / "data"
        data.mkdir()
        if pg_user is not None:
            for p in (base, data):
                os.chown(p, pg_user.pw_uid, pg_user.pw_gid)
        port = free_port()
        try:
            subprocess.run(_as_postgres([str(bin_dir / "initdb"), "-D", str(data), "--auth=trust", "-U", "postgres"]),
                           check=True, capture_output=True, timeout=120)
            opts = f"-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={data} -c fsync=off"
            subprocess.run(_as_postgres([str(bin_dir / "pg_ctl"), "-D", str(data), "-o", opts, "-l", str(data / "server.log"),
                                         "-w", "start"]), check=True, capture_output=True, timeout=120)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as err:
            detail = (getattr(err, "stderr", b"") or b"").decode(errors="replace")[-500:]
            shutil.rmtree(base, ignore_errors=True)
            raise RuntimeError(f"throwaway cluster failed: {err} {detail}") from None
        cluster = cls(f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres", data, bin_dir, opts)
        reason = unreachable(cluster.url)
        if reason:
            cluster.stop()
            raise RuntimeError(f"throwaway cluster started but refuses connections: {reason}")
        return cluster

    def halt(self) -> None:
        """Stop the server (fast shutdown: every session is ended), keeping its data for :meth:`resume`."""
        subprocess.run(_as_postgres([str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop"]),
                       check=True, capture_output=True, timeout=60)

    def resume(self) -> None:
        """Start the server again, on the same port, after :meth:`halt`."""
        subprocess.run(_as_postgres([str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-o", self.options, "-l",
                                     str(self.data / "server.log"), "-w", "start"]), check=True, capture_output=True, timeout=120)

    def stop(self) -> None:
        subprocess.run(_as_postgres([str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"]),
                       capture_output=True, timeout=60)
        shutil.rmtree(self.data.parent, ignore_errors=True)
