"""A synchronizer's *presence lock* on a shard: an exclusive lock that the database or the OS releases the moment its
holder's process (or database session) dies, so a standby that gets it knows the lease holder is gone without
waiting for the lease to expire (the rule: ``platform.takeover``).

- PostgreSQL: a session-level ``pg_try_advisory_lock`` on a connection of its own, kept open for the holder's life
  (not from the ledger's pool: a pooled connection handed back would keep the lock for whoever takes it next).
  The server ends the session when the client's socket closes, and with it the lock. Behind a pooler in transaction
  mode (PgBouncer) session locks mean nothing: point the ledger URL at the server itself.
- SQLite: ``flock`` on a file beside the database, ``<db>.lease-<hash>.lock``. The kernel drops the lock when the last
  descriptor of it closes, which a process's death does. (The files stay: removing one while a holder has it locked
  would let a second holder lock a new file of the same name; a holder that finds its file replaced counts its lock
  as lost.)
- In-memory SQLite (one process): no presence lock, the lease's expiry alone tells a dead holder.

Holding the lock never grants the lease: the lease row and its fencing token do (``ledger.synchronizer``)."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import threading
from pathlib import Path
from typing import BinaryIO

from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

log = logging.getLogger("ddiloco.synchronizer")

CONNECT_TIMEOUT_S = 2
"""How long a presence connection may take to open: a lease renewal waits for it."""


def _digest(run_id: str, shard: int) -> bytes:
    return hashlib.blake2b(f"ddiloco-lease\0{run_id}\0{shard}".encode(), digest_size=8).digest()


def advisory_key(run_id: str, shard: int) -> int:
    """The 64-bit PostgreSQL advisory lock key of a run's shard."""
    return int.from_bytes(_digest(run_id, shard), "big", signed=True)


def lock_path(database: Path, run_id: str, shard: int) -> Path:
    """The file whose flock is a run's shard's presence lock on a SQLite ledger at ``database``."""
    return database.with_name(f"{database.name}.lease-{_digest(run_id, shard).hex()}.lock")


class Presence:
    """This process's presence locks of one run's shards (thread-safe: the renewer thread and the loop share it)."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._lock = threading.Lock()
        self._held: set[int] = set()

    @property
    def held(self) -> frozenset[int]:
        return frozenset(self._held)

    def hold(self, shard: int) -> bool:
        """Take the shard's lock, or check that it is still ours: True while this process holds it."""
        with self._lock:
            if shard in self._held:
                if self._still_held(shard):
                    return True
                log.warning("the presence lock of shard %s of run %s was lost", shard, self.run_id)
                self._held.discard(shard)
                self._unlock(shard)
            if self._try(shard):
                self._held.add(shard)
                return True
            return False

    def release(self, shard: int) -> None:
        with self._lock:
            if shard in self._held:
                self._held.discard(shard)
                self._unlock(shard)

    def keep_only(self, shard: int | None) -> None:
        """Release every lock but ``shard``'s (all of them with None)."""
        for other in self.held - {shard}:
            self.release(other)

    def close(self) -> None:
        """Release every lock and whatever held them (a later ``hold`` starts afresh)."""
        with self._lock:
            self._held.clear()
            self._close()

    # --- the backend's part ------------------------------------------------------------------------

    def _try(self, shard: int) -> bool:
        raise NotImplementedError

    def _still_held(self, shard: int) -> bool:
        raise NotImplementedError

    def _unlock(self, shard: int) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError


class PostgresPresence(Presence):
    """Session-level advisory locks on one dedicated connection."""

    def __init__(self, url: URL, run_id: str) -> None:
        super().__init__(run_id)
        self._engine = create_engine(url, poolclass=NullPool, isolation_level="AUTOCOMMIT",
                                     connect_args={"connect_timeout": CONNECT_TIMEOUT_S})
        self._conn: Connection | None = None

    def _run(self, sql: str, shard: int | None = None) -> object:
        """One statement on the presence connection; a connection that failed is dropped with every lock it held."""
        try:
            if self._conn is None:
                self._conn = self._engine.connect()
            params = {} if shard is None else {"key": advisory_key(self.run_id, shard)}
            return self._conn.scalar(text(sql), params)
        except DBAPIError as err:
            log.warning("presence connection of run %s failed: %s", self.run_id, str(err).splitlines()[0])
            self._held.clear()
            self._close()
            return None

    def _try(self, shard: int) -> bool:
        return self._run("SELECT pg_try_advisory_lock(:key)", shard) is True

    def _still_held(self, shard: int) -> bool:
        # A session keeps its advisory locks until it unlocks them or ends: the same session alive is the lock held.
        return self._conn is not None and self._run("SELECT 1") == 1

    def _unlock(self, shard: int) -> None:
        if self._conn is not None:
            self._run("SELECT pg_advisory_unlock(:key)", shard)

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except DBAPIError:
                pass  # the session is gone already, and its locks with it
        self._engine.dispose()


class FilePresence(Presence):
    """``flock`` on one file per shard beside the SQLite database."""

    def __init__(self, database: Path, run_id: str) -> None:
        super().__init__(run_id)
        self.database = database
        self._files: dict[int, BinaryIO] = {}
        """Open lock files: closed (and their locks let go) when released, or when this object is collected."""

    def _try(self, shard: int) -> bool:
        path = lock_path(self.database, self.run_id, shard)
        try:
            f = open(path, "ab")  # open for as long as the lock is held; not inherited by child processes (PEP 446)
        except OSError as err:
            log.warning("cannot open the presence lock file %s: %s", path.name, err.strerror)
            return False
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            return False
        self._files[shard] = f
        if not self._still_held(shard):  # the file was replaced between our open and our lock
            self._unlock(shard)
            return False
        return True

    def _still_held(self, shard: int) -> bool:
        try:
            return os.stat(lock_path(self.database, self.run_id, shard)).st_ino == os.fstat(self._files[shard].fileno()).st_ino
        except (OSError, KeyError, ValueError):  # no file, not ours, or closed
            return False

    def _unlock(self, shard: int) -> None:
        f = self._files.pop(shard, None)
        if f is not None:
            f.close()

    def _close(self) -> None:
        for shard in list(self._files):
            self._unlock(shard)


def open_presence(engine: Engine, run_id: str) -> Presence | None:
    """The presence locks of ``run_id`` on the ledger ``engine`` writes to; None where there are none (in-memory SQLite)."""
    url = engine.url
    backend = url.get_backend_name()
    if backend == "postgresql":
        return PostgresPresence(url, run_id)
    database = url.database
    if backend == "sqlite" and database and database != ":memory:" and not database.startswith("file:"):
        return FilePresence(Path(database), run_id)
    return None
