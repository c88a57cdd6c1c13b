"""What every process of a run shares: config, ledger sessions, stores, clock conversions, code version."""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker
from tenacity import before_sleep_log, retry, retry_if_exception_type, stop_after_delay, wait_exponential

import ddiloco
from ddiloco.platform.config import ConfigError, RunConfig, masked_secret_problem
from ddiloco.platform.ledger.engine import open_ledger, reader_of, session_factory
from ddiloco.platform.store import FragmentStore, open_store

Clock = Callable[[], float]

log = logging.getLogger("ddiloco.runtime")

# A ledger that restarts (PostgreSQL failover, a locked SQLite file) is retried this long.
LEDGER_RETRY_S = 120.0


def to_datetime(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=timezone.utc)


def to_timestamp(dt: datetime) -> float:
    return dt.timestamp()


def code_version() -> tuple[str, str | None]:
    """(package version, git commit of the source tree when it is a checkout)."""
    commit = None
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(ddiloco.__file__).parent, capture_output=True, text=True, timeout=5
        )
        if out.returncode == 0:
            commit = out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    return ddiloco.__version__, commit


ledger_retry = retry(
    retry=retry_if_exception_type(OperationalError),
    stop=stop_after_delay(LEDGER_RETRY_S),
    wait=wait_exponential(multiplier=0.1, max=5.0),
    reraise=True,
)


@retry(
    retry=retry_if_exception_type(OperationalError),
    stop=stop_after_delay(LEDGER_RETRY_S),
    wait=wait_exponential(multiplier=0.5, max=5.0),
    before_sleep=before_sleep_log(log, logging.WARNING),
    reraise=True,
)
def _open_ledger_retrying(cfg: RunConfig) -> Engine:
    """Open (and migrate) the ledger; a process started while the server restarts waits for it."""
    return open_ledger(cfg.ledger.url, idle_in_transaction_timeout_s=cfg.ledger.idle_in_transaction_timeout_s)


@dataclass
class RunContext:
    """Handles a process needs to take part in a run."""

    cfg: RunConfig
    run_id: str
    engine: Engine
    clock: Clock = time.time
    _sessions: sessionmaker[Session] | None = field(default=None, repr=False)
    _read_sessions: sessionmaker[Session] | None = field(default=None, repr=False)

    @classmethod
    def open(cls, cfg: RunConfig, run_id: str | None = None, clock: Clock = time.time, engine: Engine | None = None) -> RunContext:
        why = masked_secret_problem(cfg)
        if why:
            raise ConfigError(why)
        engine = engine or _open_ledger_retrying(cfg)
        return cls(cfg=cfg, run_id=run_id or cfg.name, engine=engine, clock=clock)

    @property
    def sessions(self) -> sessionmaker[Session]:
        if self._sessions is None:
            self._sessions = session_factory(self.engine)
        return self._sessions

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        """A read-write transaction (on SQLite it takes the write lock at BEGIN)."""
        with self.sessions.begin() as session:
            yield session

    @contextmanager
    def reading(self) -> Iterator[Session]:
        """A read-only transaction on one snapshot of the ledger.

        On SQLite it never waits behind writers (WAL snapshot). On PostgreSQL it is REPEATABLE READ,
        so figures read by several statements (token accounting, say) agree with each other."""
        if self._read_sessions is None:
            self._read_sessions = session_factory(reader_of(self.engine))
        with self._read_sessions.begin() as session:
            yield session

    def now(self) -> float:
        return self.clock()

    def now_dt(self) -> datetime:
        return to_datetime(self.clock())

    def store(self, region: str | None = None) -> FragmentStore:
        return open_store(self.cfg.storage_url_for(region), self.cfg.storage.fsspec_options())
