"""A synchronizer's lease of one shard of the run: which shard it may take, taking or renewing it, keeping it alive
from a thread while a long pass runs, and handing it over. The lease's token fences every write the holder makes
(``ledger.synchronizer``); this module only holds it.

Beside the lease, the holder keeps the shard's presence lock (``ledger.presence``) for as long as it holds the lease,
and says so in the lease row. A standby tries that lock at every pass on the shards whose holder said so; getting
it means the holder's process or database session died, and it takes the lease at once (``platform.takeover``)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from ddiloco.platform import takeover
from ddiloco.platform.faults import fault_point
from ddiloco.platform.ledger import synchronizer as sync_q
from ddiloco.platform.ledger.presence import open_presence
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
        self.presence = open_presence(ctx.engine, ctx.run_id)
        """This process's presence locks (None where the ledger has none: in-memory SQLite)."""
        self._guard = threading.Lock()
        self._presence_for: int | None = None
        """The one shard whose presence lock may be held or taken (the shard of the lease held or being taken)."""
        self._renewed_at: float | None = None
        """When the lease held was last renewed in the ledger (the run's clock), by a pass or the renewer thread, with
        its presence lock where the ledger has them (until the row says so, every pass tries to claim the lock)."""

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
        fragments meanwhile: the caller compares with what it held. A lease renewed lately is kept without a
        transaction (``takeover.renewal_due``): a pass would otherwise write the lease row every time."""
        if self.held is not None and not takeover.renewal_due(self._renewed_at, now, self.ctx.cfg.synchronizer.lease_ttl_s):
            return self.held
        self._renewed_at = None
        if self.held is not None:
            self._set_presence_for(self.held[0])
            candidates = [(self.held[0], self._hold_presence(self.held[0]))]
        else:
            candidates = self._candidates(now)
        got, got_present = None, False
        try:
            if candidates:
                with self.ctx.transaction() as s:
                    for shard, present in candidates:
                        token = sync_q.acquire_lease(s, self.ctx.run_id, self.holder, self.ctx.cfg.synchronizer.lease_ttl_s,
                                                     to_datetime(now), shard=shard, present=present)
                        if token is not None:
                            got, got_present = (shard, token), present
                            break
        except BaseException:
            # No answer (the ledger failed): a holder keeps its lock, a standby lets go of those it tried.
            self._set_presence_for(self.held[0] if self.held is not None else None)
            raise
        # Only the lease held keeps its presence lock; one tried for a lease not taken is let go at once.
        self._set_presence_for(got[0] if got else None)
        if got is not None and (got_present or self.presence is None):
            self._renewed_at = now
        if got is None and self.held is not None:
            log.warning("%s lost the lease of shard %s", self.holder, self.held[0])
        return got

    def _takeable(self, now: float) -> list[tuple[int, bool]]:
        """(shard, needs_lock) of every shard this holder may take (the pinned one only, if pinned): free, lapsed or
        its own (needs_lock False), or held by a holder that said it held the presence lock (needs_lock True:
        takeable once this process gets that lock).

        Read on a snapshot first, so that a standby whose every shard is held opens no write transaction: on
        SQLite that would take the ledger's one write lock at every pass, and on PostgreSQL lock the live
        holders' lease rows (acquire_lease reads them FOR UPDATE) while they renew and publish."""
        shards = [self.pinned] if self.pinned is not None else list(range(self.ctx.cfg.synchronizer.shards))
        at = to_datetime(now)
        with self.ctx.reading() as s:
            views = {lease.shard: takeover.LeaseView(lease.holder, lease.expires_at, lease.presence)
                     for lease in sync_q.leases(s, self.ctx.run_id)}
        out = []
        for shard in shards:
            # A holder that stood down after a failed pass takes its own lease back at once (same token).
            if takeover.decide_lease(views.get(shard), self.holder, at, present=False).take:
                out.append((shard, False))
            elif self.presence is not None and takeover.worth_a_presence_try(views[shard], self.holder, at):
                out.append((shard, True))
        return out

    def _candidates(self, now: float) -> list[tuple[int, bool]]:
        """(shard, presence lock held) of the shards to try, in order: those whose dead holder's presence lock was
        got, then the free or lapsed ones (each with its presence lock if that is free: one taken by a hung holder
        that still has it is tried again at every renewal)."""
        gone, free = [], []
        for shard, needs_lock in self._takeable(now):
            with self._guard:
                present = self.presence is not None and self.presence.hold(shard)
            if needs_lock and present:
                gone.append((shard, True))
            elif not needs_lock:
                free.append((shard, present))
        return gone + free

    # --- the presence lock --------------------------------------------------------------------------

    def _set_presence_for(self, shard: int | None) -> None:
        """From now on only ``shard``'s presence lock may be held (none with None): the others are let go."""
        with self._guard:
            self._presence_for = shard
            if self.presence is not None:
                self.presence.keep_only(shard)

    def _hold_presence(self, shard: int) -> bool:
        """Take or check the held lease's presence lock: whether this process holds it. The guard keeps the renewer
        thread from taking back a lock the loop has just let go with the lease."""
        with self._guard:
            if self.presence is None or self._presence_for != shard:
                return False
            return self.presence.hold(shard)

    def _drop_presence(self, shard: int) -> None:
        """Let ``shard``'s presence lock go (its lease was lost, or this holder is hung) until it is acquired again."""
        with self._guard:
            if self._presence_for == shard:
                self._presence_for = None
                if self.presence is not None:
                    self.presence.keep_only(None)

    def release(self) -> None:
        """Hand over at once instead of making a standby wait for the lease to expire; then let the presence lock go."""
        try:
            if self.held is not None:
                with self.ctx.transaction() as s:
                    sync_q.release_lease(s, self.ctx.run_id, self.holder, self.held[1], to_datetime(self.ctx.now()), shard=self.held[0])
                self.held = None
        finally:
            self._set_presence_for(None)
            if self.presence is not None:
                self.presence.close()

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
                # A pass stuck this long is a hung synchronizer: let the lease go (its presence lock at once, the
                # lease itself by expiry) so a standby takes over.
                log.error("%s: a poll has run for over %.0fs; no longer renewing the lease", self.holder, sc.max_poll_s)
                self._drop_presence(shard)
                continue
            try:
                present = self._hold_presence(shard)
                at = self.ctx.now()
                with self.ctx.transaction() as s:
                    renewed = sync_q.renew_lease(s, self.ctx.run_id, self.holder, token, ttl, to_datetime(at), shard=shard,
                                                 present=present)
                    fault_point("sync.renew_lease")
                self._renewed_at = at if renewed and (present or self.presence is None) else None
                if not renewed:
                    log.warning("%s could not renew its lease of shard %s (token %s)", self.holder, shard, token)
                    self._drop_presence(shard)
            except Exception:  # noqa: BLE001 - the ledger may be restarting; the fence keeps writes safe
                log.exception("lease renewal failed")
