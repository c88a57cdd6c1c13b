"""Who may take a synchronizer shard's lease, and why: one home for the rule the ledger applies inside the lease
row's lock and a standby applies to decide which presence locks are worth trying.

A lease is taken when it is free, when it has expired, or at once when its holder is known to be gone: the lease
says the holder held the shard's *presence lock* (``presence``), a lock the database or the OS releases the moment
the holder's process or session dies (``ledger.presence``), and the taker now holds that lock itself. A holder that
is alive but hung keeps its presence lock, so it loses the lease only by expiry; the fencing token, bumped at every
change of holder, refuses the writes of whichever holder lost it."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

FREE = "free"
OWN = "own"
EXPIRED = "expired"
GONE = "gone"
LIVE = "live"


@dataclass(frozen=True)
class LeaseView:
    """What the rule reads of a lease row."""

    holder: str
    expires_at: datetime
    presence: bool
    """The holder held the shard's presence lock when it last wrote the lease."""


@dataclass(frozen=True)
class LeaseDecision:
    take: bool
    kind: str
    """FREE (no lease yet), OWN (the taker's own: renewed, same token), EXPIRED or GONE (a takeover: token + 1),
    LIVE (someone else's live lease: refused)."""
    reason: str

    @property
    def takeover(self) -> bool:
        """Another holder's lease changes hands: the fencing token grows."""
        return self.kind in (EXPIRED, GONE)


def decide_lease(lease: LeaseView | None, holder: str, now: datetime, present: bool) -> LeaseDecision:
    """May ``holder`` take (or keep) the lease at ``now``? ``present``: it holds the shard's presence lock now."""
    if lease is None:
        return LeaseDecision(True, FREE, "never held")
    if lease.holder == holder:
        return LeaseDecision(True, OWN, "already its holder")
    if lease.expires_at <= now:
        return LeaseDecision(True, EXPIRED, f"{lease.holder}'s lease expired")
    if lease.presence and present:
        # The lock is exclusive: holding it now means the holder that had it no longer does, and a holder lets
        # it go only after giving up the lease, or by dying (its process or its database session).
        return LeaseDecision(True, GONE, f"{lease.holder}'s session ended")
    if lease.presence:
        return LeaseDecision(False, LIVE, f"{lease.holder} holds it and its presence lock")
    return LeaseDecision(False, LIVE, f"{lease.holder} holds it until {lease.expires_at.isoformat()} (no presence lock to tell its death)")


def worth_a_presence_try(lease: LeaseView, holder: str, now: datetime) -> bool:
    """A standby tries the presence lock of a live lease only where getting it would let it take over: someone
    else's lease that says its holder held the lock (an expired or own lease needs no lock)."""
    return decide_lease(lease, holder, now, present=True).kind == GONE


def renewal_due(renewed_at: float | None, now: float, ttl_s: float) -> bool:
    """Must a holder's pass renew its lease in the ledger? Not within a third of the TTL of the last renewal (the
    previous pass's or the renewer thread's): two thirds of it are still left before a standby may take it by expiry,
    and whatever a holder writes meanwhile is fenced by its token anyway. A clock that went back counts as due."""
    return renewed_at is None or not 0 <= now - renewed_at < ttl_s / 3
