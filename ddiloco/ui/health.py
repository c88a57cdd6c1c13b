"""What the dashboard says about a run's health: pure functions of (now, a snapshot of the ledger, policy).

Nothing here reads the clock or the ledger. Each decision returns a readable reason with its
verdict, so the page can say *why* a learner is dead or a run is degraded, and tests move time by
editing timestamps. Learner verdicts come from ``ddiloco.platform.liveness``, the rule the
synchronizer writes to the ledger too: the dashboard recomputes them from heartbeats because the
stored status goes stale exactly when it matters most — when the synchronizer is down."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from ddiloco.platform.liveness import (
    ALIVE,
    CUT_OFF,
    DEAD,
    LEARNER_STATUSES,
    RECOVERING,
    REGION_UP,
    STRAGGLING,
    LivenessPolicy,
    Verdict,
    format_duration,
)
from ddiloco.platform.units import format_bytes, format_count  # noqa: F401 - the views format through this module

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
    CUT_OFF: "red",
    REGION_UP: "green",  # a region down (liveness.REGION_DOWN) is the run's DOWN below: the same word, the same red
    HEALTHY: "green",
    STARTING: "blue",
    DEGRADED: "orange",
    DOWN: "red",
    FAILED: "red",
    FINISHED: "gray",
    "stopped": "gray",
    "ended": "gray",
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
class HealthPolicy(LivenessPolicy):
    """Thresholds, taken from the run's own config so the dashboard agrees with the synchronizer."""

    stall_after_s: float = 30.0
    """No new global version for this long while learners are alive: the run is stalled."""

    @classmethod
    def from_config(cls, config: dict) -> HealthPolicy:
        live = LivenessPolicy.from_learners_config(config.get("learners") or {})
        return cls(
            dead_after_s=live.dead_after_s,
            straggler_factor=live.straggler_factor,
            stall_after_s=max(cls.stall_after_s, 2 * live.dead_after_s),
        )


# --- synchronizer --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LeaseSnapshot:
    holder: str
    token: int
    acquired_at: datetime
    expires_at: datetime
    shard: int = 0


@dataclass(frozen=True)
class SyncVerdict:
    status: str
    """active (a holder's lease is live), none (nobody holds a live lease), never (no lease yet), ended (the run has
    ended: whose lease is live no longer matters)."""
    holder: str | None
    message: str
    last_version_age_s: float | None


def synchronizer_verdict(
    leases: Sequence[LeaseSnapshot], last_version_at: datetime | None, now: datetime, *, run_running: bool = True,
    shards: int = 1,
) -> SyncVerdict:
    """Active when every one of the run's ``shards`` has a live lease; else which shard has none, and since when. An
    ended run's synchronizers are named as its last holders, with no time measured against ``now``."""
    age = (now - last_version_at).total_seconds() if last_version_at is not None else None
    by_shard = {lease.shard: lease for lease in leases}
    where = (lambda k: f"shard {k}: ") if shards > 1 else (lambda k: "")  # noqa: E731 - one shard reads as before
    if not run_running:
        held = "; ".join(f"{where(k)}{by_shard[k].holder} held the lease last (token {by_shard[k].token})" for k in sorted(by_shard))
        return SyncVerdict("ended", None, f"the run has ended; {held}" if held else "the run has ended; no synchronizer ever held "
                           "its lease", age)
    if not by_shard:
        return SyncVerdict("never", None, "no synchronizer has ever held this run's lease", age)
    live = [by_shard[k] for k in range(shards) if k in by_shard and by_shard[k].expires_at > now]
    if len(live) == shards:
        return SyncVerdict(
            "active",
            ", ".join(lease.holder for lease in live),
            "; ".join(f"{where(lease.shard)}{lease.holder} holds the lease (token {lease.token}, renew due in "
                      f"{format_duration((lease.expires_at - now).total_seconds())})" for lease in live),
            age,
        )
    lapsed = [k for k in range(shards) if k not in {lease.shard for lease in live}]
    return SyncVerdict(
        "none",
        None,
        "; ".join(
            f"no active synchronizer: {where(k)}the lease of {by_shard[k].holder} (token {by_shard[k].token}) expired "
            f"{format_duration((now - by_shard[k].expires_at).total_seconds())} ago and no standby has taken over"
            if k in by_shard else f"no active synchronizer: {where(k)}no synchronizer has ever held its lease"
            for k in lapsed
        ),
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


def run_health(run_status: str, verdicts: dict[str, Verdict], sync: SyncVerdict, policy: HealthPolicy,
               regions: dict[str, Verdict] | None = None, failed_why: str | None = None) -> RunHealth:
    """One badge for the run, with every reason that made it so (worst first); a region cut off (``regions``, from
    ``liveness.region_verdicts``) is named before the dead learners it explains. ``failed_why``: what the event that
    ended a failed run says."""
    if run_status == "finished":
        return RunHealth(FINISHED, ["the run finished"])
    if run_status == "failed":
        return RunHealth(FAILED, [f"the run failed: {failed_why}" if failed_why else "the run is marked failed"])
    if run_status == "stopped":
        return RunHealth(FINISHED, ["the run was stopped"])
    if run_status != "running":
        return RunHealth(run_status, [f"the run is {run_status}"])
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
    degraded += [f"region {region} {v.reason}" for region, v in (regions or {}).items() if v.status == CUT_OFF]
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
    "region_cut_off": "failure",
    "learner_exited": "failure",
    "run_failed": "failure",
    "learner_restarted": "restart",
    "learner_relaunched": "restart",
    "chaos": "chaos",
    "submission_rejected": "rejection",
    "lease_acquired": "synchronizer",
    "synchronizer_launched": "synchronizer",
    "learner_joined": "learner",
    "learner_launched": "learner",
    "link_cadence": "learner",
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

