"""Who is alive: the one rule for a learner's status, as a pure function of (snapshot, now, policy), and what it
says of a whole region (:func:`region_verdicts`: cut off, when all its learners fell silent together).

The synchronizer's status writer and live set and the dashboard all call :func:`learner_verdicts` and
:func:`region_verdicts`; nothing here reads the clock or the ledger, and every verdict carries its reason."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

ALIVE = "alive"
STRAGGLING = "straggling"
DEAD = "dead"
RECOVERING = "recovering"
LEARNER_STATUSES = (ALIVE, STRAGGLING, RECOVERING, DEAD)

REGION_UP = "up"
"""A region with at least one live learner."""
REGION_DOWN = "down"
"""Every learner of the region dead, but not together (deaths one by one), or a lone learner."""
CUT_OFF = "cut off"
"""Every learner of the region dead, all fallen silent together: a partition or a region outage."""
REGION_STATUSES = (REGION_UP, REGION_DOWN, CUT_OFF)
MIN_CUT_OFF_LEARNERS = 2
"""Learners that must fall silent together for a region to be judged cut off: one learner's silence is its own
death as much as a cut, and its own verdict already says it is dead."""


@dataclass(frozen=True)
class LivenessPolicy:
    """Thresholds, from the run's ``learners`` config."""

    dead_after_s: float = 10.0
    """No heartbeat for this long: dead (``learners.dead_after_s``)."""
    straggler_factor: float = 2.0
    """Step time above this multiple of the live median: straggling (``learners.straggler_factor``)."""

    @classmethod
    def from_learners_config(cls, learners: Mapping | object) -> LivenessPolicy:
        """From ``RunConfig.learners`` or its recorded dict form (old runs may lack a key: defaults)."""
        get = learners.get if isinstance(learners, Mapping) else lambda k, d: getattr(learners, k, d)
        return cls(
            dead_after_s=float(get("dead_after_s", cls.dead_after_s)),
            straggler_factor=float(get("straggler_factor", cls.straggler_factor)),
        )


@dataclass(frozen=True)
class LearnerSnapshot:
    id: str
    last_heartbeat_at: datetime | None
    started_at: datetime
    step: int
    step_time_s: float
    ledger_status: str
    """As last written by the synchronizer (``learners.status``)."""
    region: str = ""


@dataclass(frozen=True)
class Verdict:
    status: str
    reason: str


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


def last_heard(snap: LearnerSnapshot) -> datetime:
    """When the learner was last heard of (its start counts as a sign of life)."""
    return snap.last_heartbeat_at or snap.started_at


def silent_s(snap: LearnerSnapshot, now: datetime) -> float:
    """Seconds since the learner was last heard of."""
    return (now - last_heard(snap)).total_seconds()


def dead_since(snap: LearnerSnapshot, policy: LivenessPolicy) -> datetime:
    """When the learner is dead by :func:`is_dead` if it stays silent: last heard of plus ``dead_after_s``."""
    return last_heard(snap) + timedelta(seconds=policy.dead_after_s)


def is_dead(silent: float, policy: LivenessPolicy) -> bool:
    """The one rule of who is dead: not heard of for longer than ``learners.dead_after_s``. The synchronizer's
    verdicts (so the ledger, the quorum and the dashboard) and the supervisor's relaunches judge by it."""
    return silent > policy.dead_after_s


def median_live_step_s(snaps: Iterable[LearnerSnapshot], now: datetime, policy: LivenessPolicy) -> float:
    times = sorted(s.step_time_s for s in snaps if not is_dead(silent_s(s, now), policy) and s.step_time_s > 0)
    return times[len(times) // 2] if times else 0.0


def learner_verdict(snap: LearnerSnapshot, now: datetime, policy: LivenessPolicy, median_step_s: float) -> Verdict:
    """Dead beats straggling beats recovering beats alive."""
    silent = silent_s(snap, now)
    if is_dead(silent, policy):
        return Verdict(DEAD, f"no heartbeat for {format_duration(silent)} (limit {format_duration(policy.dead_after_s)})")
    if median_step_s > 0 and snap.step_time_s > policy.straggler_factor * median_step_s:
        ratio = snap.step_time_s / median_step_s
        return Verdict(STRAGGLING, f"step time {snap.step_time_s:.2f}s is {ratio:.1f}x the live median {median_step_s:.2f}s")
    if snap.ledger_status == RECOVERING and snap.step == 0:
        return Verdict(RECOVERING, "restarted; rejoining from the newest global state")
    return Verdict(ALIVE, f"last heartbeat {format_duration(silent)} ago")


def learner_verdicts(snaps: Sequence[LearnerSnapshot], now: datetime, policy: LivenessPolicy) -> dict[str, Verdict]:
    """Every learner's verdict, judged against the median step time of the live ones."""
    median = median_live_step_s(snaps, now, policy)
    return {s.id: learner_verdict(s, now, policy, median) for s in snaps}


def live_ids(verdicts: Mapping[str, Verdict]) -> list[str]:
    """The learners that count as live for quorum and grace: every one not dead, sorted."""
    return sorted(lid for lid, v in verdicts.items() if v.status != DEAD)


def _clock(t: datetime) -> str:
    """A time of day as the dashboard shows every time: UTC."""
    return f"{t.astimezone(timezone.utc) if t.tzinfo is not None else t:%H:%M:%S}"


def region_verdict(snaps: Sequence[LearnerSnapshot], now: datetime, policy: LivenessPolicy) -> Verdict:
    """One region's learners: cut off when every one is dead and the last of them fell silent together (at least
    :data:`MIN_CUT_OFF_LEARNERS` within ``dead_after_s`` of the last); down when all are dead otherwise; up while one
    is live. Learners dead before the cut (never relaunched) do not hide it."""
    n = len(snaps)
    dead = sum(is_dead(silent_s(s, now), policy) for s in snaps)
    if dead < n:
        return Verdict(REGION_UP, f"{n - dead} of {n} learners live")
    heard = sorted(last_heard(s) for s in snaps)
    last = heard[-1]
    silent = format_duration((now - last).total_seconds())
    if n < MIN_CUT_OFF_LEARNERS:
        return Verdict(REGION_DOWN, f"its only learner is dead (silent {silent}): one learner's death and a cut look alike")
    # The liveness rule takes any silence shorter than dead_after_s for jitter: silences that began within that
    # much of each other are as simultaneous as it can tell, while deaths one by one fall anywhere.
    together = [t for t in heard if (last - t).total_seconds() <= policy.dead_after_s]
    if len(together) < MIN_CUT_OFF_LEARNERS:
        gap = format_duration((last - heard[-2]).total_seconds())
        return Verdict(REGION_DOWN, f"all {n} learners dead, the last fallen silent {gap} after the one before it (more than "
                                    f"{format_duration(policy.dead_after_s)}): separate deaths, not a cut")
    who = f"all {n} learners" if len(together) == n else f"{len(together)} of {n} learners (the rest dead before)"
    return Verdict(CUT_OFF, f"{who} silent since {_clock(last)} ({silent}): cut off from the ledger?")


def region_verdicts(snaps: Sequence[LearnerSnapshot], now: datetime, policy: LivenessPolicy) -> dict[str, Verdict]:
    """Every region's verdict (:func:`region_verdict`), regions sorted by name."""
    by_region: dict[str, list[LearnerSnapshot]] = defaultdict(list)
    for s in snaps:
        by_region[s.region].append(s)
    return {region: region_verdict(group, now, policy) for region, group in sorted(by_region.items())}
