"""A synchronizer's lease of one shard of the run: which shard it may take, taking or renewing it, keeping it alive
from a thread while a long pass runs, and handing it over. The lease's token fences every write the holder makes
(``ledger.synchronizer``); this module only holds it."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from ddiloco.platform.faults import fault_point
from ddiloco.platform.ledger import synchronizer as sync_q
from ddiloco.platform.runtime import RunContext, to_datetime

log = logging.getLogger("ddiloco.synchronizer")


def holder_name(label: str = "sync") -> str:
    """``label@host:pid``: unique per process, and tells a supervisor where the holder runs."""
    return f"{label}@{socket.gethostname()}:{os.getpid()}"


def parse_holder(holder: str) -> tuple[str, str, int] | None:
    """(label, host, pid) of a holder name made by holder_name, else None."""
    label, at, where = holder.rpartition("@")
    host, colon, pid = where.rpartition(":")
    if not at or not colon or not pid.isdigit():
        return None
    return label, host, int(pid)


class ShardLease:
    """One holder's lease of a shard: ``pinned`` to one shard, else whichever shard's lease is free (one at a time)."""

    def __init__(self, ctx: RunContext, holder: str, pinned: int | None = None) -> None:
        self.ctx = ctx
        self.holder = holder
        self.pinned = pinned
        self.held: tuple[int, int] | None = None
        """(shard, fencing token) of the lease this holder has, if any."""

    @property
    def token(self) -> int | None:
        """The fencing token of the lease held (None on standby)."""
        return self.held[1] if self.held else None

    @property
    def shard(self) -> int | None:
        """The shard whose lease is held (None on standby)."""
        return self.held[0] if self.held else None

    def acquire(self, now: float) -> tuple[int, int] | None:
        """Take or renew a shard's lease (the pinned one, else the one held, else the first free one): (shard,
        token), or None (``held`` is then None). A new token means someone else may have published that shard's
        fragments meanwhile: the caller compares with what it held."""
        candidates = [self.held[0]] if self.held is not None else self.free_shards(now)
        got = None
        if candidates:
            with self.ctx.transaction() as s:
                for shard in candidates:
                    token = sync_q.acquire_lease(s, self.ctx.run_id, self.holder, self.ctx.cfg.synchronizer.lease_ttl_s,
                                                 to_datetime(now), shard=shard)
                    if token is not None:
                        got = (shard, token)
                        break
        if got is None and self.held is not None:
            log.warning("%s lost the lease of shard %s", self.holder, self.held[0])
        return got

    def free_shards(self, now: float) -> list[int]:
        """The shards a standby may take: never held, or their lease lapsed (the pinned one only, if pinned).

        Read on a snapshot first, so that a standby whose every shard is held opens no write transaction: on
        SQLite that would take the ledger's one write lock at every pass, and on PostgreSQL lock the live
        holders' lease rows (acquire_lease reads them FOR UPDATE) while they renew and publish."""
        shards = [self.pinned] if self.pinned is not None else list(range(self.ctx.cfg.synchronizer.shards))
        with self.ctx.reading() as s:
            live = {lease.shard for lease in sync_q.leases(s, self.ctx.run_id) if lease.expires_at > to_datetime(now)}
        return [shard for shard in shards if shard not in live]

    def release(self) -> None:
        """Hand over at once instead of making a standby wait for the lease to expire."""
        if self.held is not None:
            with self.ctx.transaction() as s:
                sync_q.release_lease(s, self.ctx.run_id, self.holder, self.held[1], to_datetime(self.ctx.now()), shard=self.held[0])
            self.held = None

    def renew_loop(self, stop: threading.Event, poll_started: Callable[[], float | None]) -> None:
        """Keep the lease alive while a long merge or evaluation runs on the main thread; ``poll_started``: when
        the pass under way began (time.monotonic; None between passes)."""
        sc = self.ctx.cfg.synchronizer
        ttl = sc.lease_ttl_s
        while not stop.wait(ttl / 3):
            held = self.held
            if held is None:
                continue
            shard, token = held
            started = poll_started()
            if started is not None and time.monotonic() - started > sc.max_poll_s:
                # A pass stuck this long is a hung synchronizer: let the lease lapse so a standby takes over.
                log.error("%s: a poll has run for over %.0fs; no longer renewing the lease", self.holder, sc.max_poll_s)
                continue
            try:
                with self.ctx.transaction() as s:
                    renewed = sync_q.renew_lease(s, self.ctx.run_id, self.holder, token, ttl, to_datetime(self.ctx.now()), shard=shard)
                    fault_point("sync.renew_lease")
                if not renewed:
                    log.warning("%s could not renew its lease of shard %s (token %s)", self.holder, shard, token)
            except Exception:  # noqa: BLE001 - the ledger may be restarting; the fence keeps writes safe
                log.exception("lease renewal failed")
