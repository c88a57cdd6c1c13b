"""Failover at the speed of the failure: who may take a lease (a pure rule), the presence locks that tell a dead
holder (PostgreSQL advisory locks, SQLite file locks), and a standby's lease taking over at once when the holder's
locks die and never while the holder is alive. The same with real processes: tests/test_processes.py."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import text
from support import tiny_config

from ddiloco.platform import takeover
from ddiloco.platform.ledger import open_ledger
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger import synchronizer as sync_q
from ddiloco.platform.ledger.presence import FilePresence, PostgresPresence, lock_path, open_presence
from ddiloco.platform.runtime import RunContext, to_timestamp
from ddiloco.synchronizer.lease import ShardLease
from ddiloco.testing.net import wait_for

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


# --- the rule -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lease", "present", "kind", "take"),
    [
        (None, False, takeover.FREE, True),
        (takeover.LeaseView("me", at(10), presence=False), False, takeover.OWN, True),
        (takeover.LeaseView("a", at(-1), presence=True), False, takeover.EXPIRED, True),
        (takeover.LeaseView("a", at(0), presence=False), False, takeover.EXPIRED, True),  # expires_at == now: lapsed
        (takeover.LeaseView("a", at(10), presence=True), True, takeover.GONE, True),  # its lock is ours now: it died
        (takeover.LeaseView("a", at(10), presence=True), False, takeover.LIVE, False),  # it still holds its lock
        # A holder that never had the lock (took it by expiry from a hung one) is not stolen from by whoever gets it.
        (takeover.LeaseView("a", at(10), presence=False), True, takeover.LIVE, False),
    ],
)
def test_who_may_take_a_lease_and_why(lease, present, kind, take):
    decision = takeover.decide_lease(lease, "me", at(0), present)
    assert (decision.kind, decision.take) == (kind, take)
    assert decision.takeover == (kind in (takeover.EXPIRED, takeover.GONE))
    assert decision.reason


def test_a_standby_tries_a_presence_lock_only_where_it_could_take_over():
    assert takeover.worth_a_presence_try(takeover.LeaseView("a", at(10), True), "me", at(0))
    assert not takeover.worth_a_presence_try(takeover.LeaseView("a", at(10), False), "me", at(0))
    assert not takeover.worth_a_presence_try(takeover.LeaseView("me", at(10), True), "me", at(0))


# --- the presence locks -----------------------------------------------------------------------------------


@pytest.fixture
def engine(ledger_url):
    engine = open_ledger(ledger_url)
    try:
        yield engine
    finally:
        engine.dispose()


def test_a_presence_lock_is_exclusive_per_run_and_shard_and_freed_when_its_holder_lets_go(engine):
    first, second, other_run = open_presence(engine, "r1"), open_presence(engine, "r1"), open_presence(engine, "r2")
    try:
        assert first.hold(0) and first.hold(0)  # taken, then checked
        assert not second.hold(0)  # refused while the first holds it
        assert second.hold(1) and other_run.hold(0)  # another shard, another run: other locks
        first.keep_only(None)
        assert first.held == frozenset() and second.hold(0)
        assert not first.hold(0)
        second.close()  # a process's end: every lock it held is free, once the server has ended its session
        wait_for(lambda: first.hold(0) and first.hold(1), 10, "the closed session's locks to be free")
    finally:
        for p in (first, second, other_run):
            p.close()


def backend_ended(engine, pid: int) -> bool:
    """Whether PostgreSQL's backend process ``pid`` has exited: a session's advisory locks are released only then,
    some time after its client closed the connection or the server was told to terminate it."""
    with engine.connect() as conn:
        return bool(conn.scalar(text("SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}))


def test_a_presence_lock_dies_with_its_session_or_file(engine):
    """What a SIGKILL does, in one process: the PostgreSQL session ends (terminated by the server), or the lock
    file's descriptor closes. The other taker gets the lock at once; the first finds it lost."""
    first, second = open_presence(engine, "r1"), open_presence(engine, "r1")
    try:
        assert first.hold(0) and not second.hold(0)
        if isinstance(first, PostgresPresence):
            pid = first._conn.scalar(text("SELECT pg_backend_pid()"))
            with engine.connect() as conn:
                assert conn.scalar(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
            # pg_terminate_backend only signals the backend; its locks go when it has exited.
            wait_for(lambda: backend_ended(engine, pid), 10, "the terminated session to end")
            assert second.hold(0)
        else:
            assert isinstance(first, FilePresence)
            first._files[0].close()  # the descriptor goes, as at a process's death
            assert second.hold(0)
        assert not first.hold(0)  # lost, and the other holds it now
    finally:
        first.close()
        second.close()


def test_a_replaced_lock_file_counts_as_a_lost_lock(tmp_path):
    database = tmp_path / "ledger.db"
    first, second = FilePresence(database, "r1"), FilePresence(database, "r1")
    try:
        assert first.hold(0)
        lock_path(database, "r1", 0).unlink()  # an operator cleaning up: a new file would have no lock on it
        assert second.hold(0)
        assert not first.hold(0)
    finally:
        first.close()
        second.close()


def test_an_in_memory_ledger_has_no_presence_locks():
    engine = open_ledger("sqlite://")
    assert open_presence(engine, "r1") is None


# --- a standby's lease ---------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = to_timestamp(T0)

    def __call__(self) -> float:
        return self.t


def two_holders(engine, name: str) -> tuple[ShardLease, ShardLease, Clock]:
    cfg = tiny_config(name=name, synchronizer={"lease_ttl_s": 3.0})
    clock = Clock()
    ctx = RunContext(cfg=cfg, run_id=name, engine=engine, clock=clock)
    with ctx.transaction() as s:
        runs_q.create_run(s, name, config_json="{}", code_version="t", git_commit=None, num_fragments=1, token_budget=1, now=T0)
    return ShardLease(ctx, "a"), ShardLease(ctx, "b"), clock


def lease_row(lease: ShardLease):
    with lease.ctx.reading() as s:
        row = sync_q.current_lease(s, lease.ctx.run_id)
        return row.holder, row.token, row.presence


def test_a_standby_takes_over_at_once_when_the_holders_presence_dies_and_never_from_a_live_one(engine):
    a, b, clock = two_holders(engine, "fast")
    try:
        assert a.acquire(clock.t) == (0, 1)
        a.held = (0, 1)
        assert lease_row(a) == ("a", 1, True) and a.presence.held == {0}
        clock.t += 1.0
        assert b.acquire(clock.t) is None  # a holds the lease and its lock
        assert b.presence.held == frozenset()  # the lock b tried is not kept
        pid = a.presence._conn.scalar(text("SELECT pg_backend_pid()")) if isinstance(a.presence, PostgresPresence) else None
        a.presence.close()  # a's process dies: its lock goes with it; its lease has 2 s to run
        if pid is not None:
            # Its lock goes when the server's backend of that session has exited, which closing the connection only
            # starts: a loaded suite run tried the lock in between and failed.
            wait_for(lambda: backend_ended(engine, pid), 10, "the closed session's backend to exit")
        assert b.acquire(clock.t) == (0, 2)
        assert lease_row(b) == ("b", 2, True)
        with b.ctx.reading() as s:
            events = [e.detail for e in reversed(runs_q.events(s, "fast")) if e.kind == "lease_acquired"]
        assert events[-1] == "token 2; took over from a (its session ended)"
    finally:
        a.release()
        b.release()


def lease_expiry(lease: ShardLease) -> float:
    with lease.ctx.reading() as s:
        return to_timestamp(sync_q.current_lease(s, lease.ctx.run_id).expires_at)


def test_a_holder_writes_its_lease_a_third_of_a_ttl_apart_and_notices_a_takeover_at_the_next_write(engine):
    """Every pass asks for the lease, but only one a third of the TTL after the last renewal writes the row: two thirds
    of the lease are left meanwhile, and what a holder that lost it writes meanwhile is fenced by its token."""
    a, b, clock = two_holders(engine, "renew")
    try:
        a.held = a.acquire(clock.t)
        written = lease_expiry(a)
        clock.t += 0.9
        assert a.acquire(clock.t) == (0, 1) and lease_expiry(a) == written  # a third of the TTL is 1 s: no write
        clock.t += 0.2
        assert a.acquire(clock.t) == (0, 1) and lease_expiry(a) == pytest.approx(written + 1.1, abs=1e-3)
        a.presence.keep_only(None)  # a's session ends: its presence lock goes, and b takes over at once
        assert b.acquire(clock.t) == (0, 2)
        b.held = (0, 2)
        clock.t += 0.5
        assert a.acquire(clock.t) == (0, 1)  # not written for 0.5 s: a does not know yet (its writes are fenced)
        clock.t += 0.5
        assert a.acquire(clock.t) is None  # its next write finds the lease gone
        assert lease_row(b) == ("b", 2, True)
    finally:
        a.release()
        b.release()


def test_a_lease_taken_by_expiry_from_a_hung_holder_gets_its_presence_once_the_hung_one_lets_go(engine):
    """The hung holder keeps its lock: the standby waits out the lease, takes it without the lock (presence false, so
    nobody steals from it on the strength of that lock), and claims the lock once the old holder stands down."""
    a, b, clock = two_holders(engine, "hung")
    try:
        a.held = a.acquire(clock.t)
        clock.t += 2.9
        assert b.acquire(clock.t) is None  # live, and a's lock is held
        clock.t += 0.2  # a hung: its lease lapsed
        b.held = b.acquire(clock.t)
        assert b.held == (0, 2) and lease_row(b) == ("b", 2, False)
        assert a.acquire(clock.t) is None  # a wakes: the lease is gone, and so is its lock
        assert a.presence.held == frozenset()
        assert b.acquire(clock.t) == (0, 2) and lease_row(b) == ("b", 2, True)  # b's next renewal claims the lock
    finally:
        a.release()
        b.release()


def test_a_renewal_is_due_a_third_of_the_ttl_after_the_last_and_whenever_the_clock_went_back():
    assert takeover.renewal_due(None, 5.0, 3.0)  # never renewed (or the last renewal did not record the presence lock)
    assert not takeover.renewal_due(5.0, 5.0, 3.0) and not takeover.renewal_due(5.0, 5.99, 3.0)
    assert takeover.renewal_due(5.0, 6.0, 3.0) and takeover.renewal_due(5.0, 4.9, 3.0)
