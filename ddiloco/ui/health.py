"""What the dashboard says about a run's health: pure functions of (now, a snapshot of the ledger, policy).

Nothing here reads the clock or the ledger. Each decision returns a readable reason with its
verdict, so the page can say *why* a learner is dead or a run is degraded, and tests move time by
editing timestamps. The learner rules mirror ``queries.update_learner_statuses`` (the
synchronizer's own verdict): the dashboard recomputes them from heartbeats because the stored
status goes stale exactly when it matters most — when the synchronizer is down."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Iterable, Sequence

# Learner statuses.
ALIVE = "alive"
STRAGGLING = "straggling"
DEAD = "dead"
RECOVERING = "recovering"
LEARNER_STATUSES = (ALIVE, STRAGGLING, RECOVERING, DEAD)

# Run health levels, worst last.
FINISHED = "finished"
HEALTHY = "healthy"
STARTING = "starting"
DEGRADED = "degraded"
DOWN = "down"
FAILED = "failed"

# Streamlit colour names (st.badge, :color[...]) and hex colours (charts) for every status.
STATUS_COLORS: dict[str, str] = {
    ALIVE: "green",
    STRAGGLING: "orange",
    RECOVERING: "blue",
    DEAD: "red",
    HEALTHY: "green",
    STARTING: "blue",
    DEGRADED: "orange",
    DOWN: "red",
    FAILED: "red",
    FINISHED: "gray",
    "stopped": "gray",
    "active": "green",
    "standby": "gray",
    "none": "red",
    "never": "red",
}
HEX = {
    "green": "#21a453",
    "orange": "#f08c00",
    "blue": "#1c83e1",
    "red": "#e03131",
    "gray": "#868e96",
    "violet": "#7048e8",
    "yellow": "#e0a800",
}


def color_of(status: str) -> str:
    return STATUS_COLORS.get(status, "gray")


def hex_of(status: str) -> str:
    return HEX[color_of(status)]


@dataclass(frozen=True)
class HealthPolicy:
    """Thresholds, taken from the run's own config so the dashboard agrees with the synchronizer."""

    dead_after_s: float = 10.0
    """No heartbeat for this long: dead (``learners.dead_after_s``)."""
    straggler_factor: float = 2.0
    """Step time above this multiple of the live median: straggling (``learners.straggler_factor``)."""
    stall_after_s: float = 30.0
    """No new global version for this long while learners are alive: the run is stalled."""

    @classmethod
    def from_config(cls, config: dict) -> "HealthPolicy":
        learners = config.get("learners") or {}
        dead = float(learners.get("dead_after_s", cls.dead_after_s))
        return cls(
            dead_after_s=dead,
            straggler_factor=float(learners.get("straggler_factor", cls.straggler_factor)),
            stall_after_s=max(cls.stall_after_s, 2 * dead),
        )


# --- learners ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LearnerSnapshot:
    id: str
    last_heartbeat_at: datetime | None
    started_at: datetime
    step: int
    step_time_s: float
    ledger_status: str
    """As last written by the synchronizer (``learners.status``)."""


@dataclass(frozen=True)
class Verdict:
    status: str
    reason: str


def silent_s(snap: LearnerSnapshot, now: datetime) -> float:
    """Seconds since the learner was last heard of (its start counts as a sign of life)."""
    return (now - (snap.last_heartbeat_at or snap.started_at)).total_seconds()


def median_live_step_s(snaps: Iterable[LearnerSnapshot], now: datetime, policy: HealthPolicy) -> float:
    times = sorted(s.step_time_s for s in snaps if silent_s(s, now) <= policy.dead_after_s and s.step_time_s > 0)
    return times[len(times) // 2] if times else 0.0


def learner_verdict(snap: LearnerSnapshot, now: datetime, policy: HealthPolicy, median_step_s: float) -> Verdict:
    """Dead beats straggling beats recovering beats alive — the synchronizer's order."""
    silent = silent_s(snap, now)
    if silent > policy.dead_after_s:
        return Verdict(DEAD, f"no heartbeat for {format_duration(silent)} (limit {format_duration(policy.dead_after_s)})")
    if median_step_s > 0 and snap.step_time_s > policy.straggler_factor * median_step_s:
        ratio = snap.step_time_s / median_step_s
        return Verdict(STRAGGLING, f"step time {snap.step_time_s:.2f}s is {ratio:.1f}x the live median {median_step_s:.2f}s")
    if snap.ledger_status == RECOVERING and snap.step == 0:
        return Verdict(RECOVERING, "restarted; rejoining from the newest global state")
    return Verdict(ALIVE, f"last heartbeat {format_duration(silent)} ago")


def learner_verdicts(snaps: Sequence[LearnerSnapshot], now: datetime, policy: HealthPolicy) -> dict[str, Verdict]:
    median = median_live_step_s(snaps, now, policy)
    return {s.id: learner_verdict(s, now, policy, median) for s in snaps}


# --- synchronizer --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LeaseSnapshot:
    holder: str
    token: int
    acquired_at: datetime
    expires_at: datetime


@dataclass(frozen=True)
class SyncVerdict:
    status: str
    """active (a holder's lease is live), none (nobody holds a live lease), never (no lease yet)."""
    holder: str | None
    message: str
    last_version_age_s: float | None


def synchronizer_verdict(
    lease: LeaseSnapshot | None, last_version_at: datetime | None, now: datetime, *, run_running: bool = True
) -> SyncVerdict:
    age = (now - last_version_at).total_seconds() if last_version_at is not None else None
    if lease is None:
        return SyncVerdict("never", None, "no synchronizer has ever held this run's lease", age)
    if lease.expires_at > now:
        left = (lease.expires_at - now).total_seconds()
        return SyncVerdict(
            "active",
            lease.holder,
            f"{lease.holder} holds the lease (token {lease.token}, renew due in {format_duration(left)})",
            age,
        )
    gone = (now - lease.expires_at).total_seconds()
    if not run_running:
        return SyncVerdict("none", None, f"lease released by {lease.holder} {format_duration(gone)} ago (run ended)", age)
    return SyncVerdict(
        "none",
        None,
        f"no active synchronizer: the lease of {lease.holder} (token {lease.token}) expired {format_duration(gone)} ago "
        "and no standby has taken over",
        age,
    )


# --- the run --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunHealth:
    level: str
    reasons: list[str] = field(default_factory=list)

    @property
    def color(self) -> str:
        return color_of(self.level)

    @property
    def headline(self) -> str:
        return f"{self.level}: {self.reasons[0]}" if self.reasons else self.level


def count_statuses(verdicts: Iterable[Verdict]) -> dict[str, int]:
    counts = {s: 0 for s in LEARNER_STATUSES}
    for v in verdicts:
        counts[v.status] = counts.get(v.status, 0) + 1
    return counts


def run_health(run_status: str, verdicts: dict[str, Verdict], sync: SyncVerdict, policy: HealthPolicy) -> RunHealth:
    """One badge for the run, with every reason that made it so (worst first)."""
    if run_status == "finished":
        return RunHealth(FINISHED, ["the run finished"])
    if run_status == "failed":
        return RunHealth(FAILED, ["the run is marked failed"])
    if run_status != "running":
        return RunHealth(FINISHED if run_status == "stopped" else run_status, [f"the run is {run_status}"])
    counts = count_statuses(verdicts.values())
    live = counts[ALIVE] + counts[STRAGGLING] + counts[RECOVERING]
    down: list[str] = []
    degraded: list[str] = []
    if sync.status == "never" and not verdicts:
        return RunHealth(STARTING, ["waiting for a synchronizer and learners to join"])
    if sync.status != "active":
        down.append(sync.message)
    if verdicts and live == 0:
        down.append(f"all {len(verdicts)} learners are dead")
    if sync.last_version_age_s is not None and live and sync.last_version_age_s > policy.stall_after_s:
        down.append(f"no new global version for {format_duration(sync.last_version_age_s)}")
    if counts[DEAD] and live:
        degraded.append(f"{counts[DEAD]} of {len(verdicts)} learners dead")
    if counts[STRAGGLING]:
        degraded.append(f"{counts[STRAGGLING]} straggling")
    if counts[RECOVERING]:
        degraded.append(f"{counts[RECOVERING]} recovering")
    if down:
        return RunHealth(DOWN, down + degraded)
    if not verdicts:
        return RunHealth(STARTING, ["no learner has joined yet"])
    if sync.last_version_age_s is None:
        return RunHealth(STARTING, ["no global version published yet"])
    if degraded:
        return RunHealth(DEGRADED, degraded)
    return RunHealth(HEALTHY, [f"{live} learners alive, synchronizer {sync.holder} merging"])


# --- events -------------------------------------------------------------------------------------------

EVENT_CATEGORIES = {
    "learner_dead": "failure",
    "run_failed": "failure",
    "learner_restarted": "restart",
    "learner_relaunched": "restart",
    "chaos": "chaos",
    "submission_rejected": "rejection",
    "lease_acquired": "synchronizer",
    "synchronizer_launched": "synchronizer",
    "learner_joined": "learner",
}
CATEGORY_COLORS = {
    "failure": "red",
    "restart": "orange",
    "chaos": "violet",
    "rejection": "yellow",
    "synchronizer": "blue",
    "learner": "green",
    "run": "gray",
    "other": "gray",
}


def event_category(kind: str) -> str:
    if kind in EVENT_CATEGORIES:
        return EVENT_CATEGORIES[kind]
    if kind.startswith("run_"):
        return "run"
    if "chaos" in kind:
        return "chaos"
    if "fail" in kind or "dead" in kind or "error" in kind:
        return "failure"
    return "other"


# --- formatting --------------------------------------------------------------------------------------


def format_duration(seconds: float | None) -> str:
    """'4.2s', '3m 05s', '2h 01m', '3d 4h' — short enough for a table cell."""
    if seconds is None:
        return "—"
    s = max(0.0, float(seconds))
    if s < 60:
        return f"{s:.1f}s" if s < 10 else f"{s:.0f}s"
    m, sec = divmod(int(round(s)), 60)
    if m < 60:
        return f"{m}m {sec:02d}s"
    h, m = divmod(m, 60)
    if h < 48:
        return f"{h}h {m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d {h}h"


def format_count(n: float | None) -> str:
    """1234 -> '1,234'; 12_345_678 -> '12.3M'."""
    if n is None:
        return "—"
    n = float(n)
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:,.0f}"


def format_bytes(n: float | None) -> str:
    if n is None:
        return "—"
    n = float(n)
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"
