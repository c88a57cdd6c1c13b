"""One synchronous group of slices (a data-parallel job, or one learner) through its failure trace.

Event-driven over the group's interruptions and repairs. Between two events the group either sits
in a pause or computes at a constant rate, taking a blocking snapshot every ``interval`` seconds of
compute; an interruption rolls it back to its last completed snapshot. Work is counted in
"full-capacity seconds": one second of the whole group computing at nominal speed."""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np


def expected_max_normal(n: float) -> float:
    """E[max of n independent N(0, 1)] (Blom's approximation; 0 for a single chip)."""
    if n <= 1:
        return 0.0
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def straggler_speed(chips: float, cv: float) -> float:
    """Throughput of a synchronous group whose step waits for the slowest of its chips."""
    return 1.0 / (1.0 + cv * expected_max_normal(chips))


def snapshot_interval(checkpoint_s: float, interval_s: float | None, group_mtbf_s: float) -> float | None:
    """Compute time between snapshots: the configured one, else Young's sqrt(2 C MTBF).

    None means continuous free snapshots (a zero cost and no interval): nothing is rolled back."""
    if interval_s is not None:
        return interval_s
    if checkpoint_s <= 0:
        return None
    return math.sqrt(2.0 * checkpoint_s * group_mtbf_s)


@dataclass(frozen=True)
class GroupTimeline:
    """What one group did: its kept work, and when the global model was advancing through it."""

    kept_work: float
    """Full-capacity seconds of work that survived (was never rolled back)."""
    lost_work: float
    """Full-capacity seconds computed and then rolled back by an interruption."""
    adv_start: np.ndarray
    adv_end: np.ndarray
    adv_work: np.ndarray
    """Advancing stretches: the group's kept work ``adv_work[i]`` was computed over
    [adv_start[i], adv_end[i]] (a stretch ends at its last snapshot before a rollback)."""
    pause_start: np.ndarray
    pause_end: np.ndarray
    """Recovery pauses (restart, downscale, upscale), clipped to the horizon."""
    horizon_s: float

    @property
    def advancing_s(self) -> float:
        return float((self.adv_end - self.adv_start)[self.adv_work > 0].sum())

    def trajectory(self) -> Trajectory:
        return Trajectory.from_timeline(self)


class Trajectory:
    """Cumulative kept work W(t), non-decreasing and piecewise linear, with its inverse."""

    def __init__(self, times: list[float], work: list[float]):
        self.times = times
        self.work = work

    @classmethod
    def from_timeline(cls, tl: GroupTimeline) -> Trajectory:
        ok = tl.adv_work > 0
        a, b, w = tl.adv_start[ok], np.maximum(tl.adv_end[ok], tl.adv_start[ok]), tl.adv_work[ok]
        cum = np.cumsum(w)
        times = np.empty(2 * len(a) + 2)
        work = np.empty(2 * len(a) + 2)
        times[0], work[0] = 0.0, 0.0
        times[1:-1:2], times[2:-1:2] = a, b
        work[1:-1:2], work[2:-1:2] = cum - w, cum
        times[-1] = max(tl.horizon_s, times[-2]) if len(a) else tl.horizon_s
        work[-1] = cum[-1] if len(a) else 0.0
        return cls(times.tolist(), work.tolist())

    @property
    def total(self) -> float:
        return self.work[-1]

    def at(self, t: float) -> float:
        """W(t)."""
        ts, ws = self.times, self.work
        i = bisect_right(ts, t)
        if i == 0:
            return 0.0
        if i >= len(ts):
            return ws[-1]
        t0, t1, w0, w1 = ts[i - 1], ts[i], ws[i - 1], ws[i]
        return w0 if t1 <= t0 else w0 + (w1 - w0) * (t - t0) / (t1 - t0)

    def time_of(self, w: float) -> float:
        """First time at which W reaches ``w`` (inf if it never does)."""
        ts, ws = self.times, self.work
        if w <= 0:
            return 0.0
        i = bisect_left(ws, w)
        if i >= len(ws):
            return math.inf
        t0, t1, w0, w1 = ts[i - 1], ts[i], ws[i - 1], ws[i]
        return t1 if w1 <= w0 else t0 + (t1 - t0) * (w - w0) / (w1 - w0)

    def times_of(self, targets: np.ndarray) -> np.ndarray:
        """Vectorised ``time_of`` for an ascending array of targets."""
        ts, ws = np.asarray(self.times), np.asarray(self.work)
        i = np.clip(np.searchsorted(ws, targets, side="left"), 1, len(ws) - 1)
        t0, t1, w0, w1 = ts[i - 1], ts[i], ws[i - 1], ws[i]
        span = np.where(w1 > w0, w1 - w0, 1.0)
        out = np.where(w1 > w0, t0 + (t1 - t0) * (targets - w0) / span, t1)
        return np.where(targets > ws[-1], np.inf, out)


def run_group(
    fail_times: np.ndarray,
    *,
    n_slices: int,
    horizon_s: float,
    elastic: bool,
    repair_s: float,
    fail_pause_s: float,
    upscale_s: float,
    checkpoint_s: float,
    interval_s: float | None,
    speed: float = 1.0,
) -> GroupTimeline:
    """Play one group through its interruptions (sorted, all < horizon, each on a healthy slice).

    Non-elastic (``elastic=False``): every interruption stops the group for ``fail_pause_s`` (a
    restart on spare slices) and rolls it back; it always runs on all its slices.
    Elastic: an interruption rolls back and pauses ``fail_pause_s`` (downscale), the group goes on
    with the slices it has left, and each slice returns ``repair_s`` later through an
    ``upscale_s`` pause. Events during a pause are absorbed by it."""
    fail_times = np.asarray(fail_times, dtype=float)
    if elastic:
        rep = fail_times + repair_s
        rep = rep[rep < horizon_s]
        times = np.concatenate([fail_times, rep])
        kinds = np.concatenate([np.zeros(len(fail_times), dtype=np.int8), np.ones(len(rep), dtype=np.int8)])
        order = np.argsort(times, kind="stable")
        times, kinds = times[order].tolist(), kinds[order].tolist()
    else:
        times, kinds = fail_times.tolist(), [0] * len(fail_times)

    cost = checkpoint_s
    cycle = None if interval_s is None else interval_s + cost
    available = joined = n_slices
    t = 0.0  # state is accounted up to t
    paused = False
    pause_end = 0.0
    pos = 0.0  # position in the compute/snapshot cycle
    at_risk = 0.0  # work since the last completed snapshot
    committed = 0.0
    lost = 0.0
    rec_start, rec_work0, last_commit_t = 0.0, 0.0, 0.0
    adv_s: list[float] = []
    adv_e: list[float] = []
    adv_w: list[float] = []
    pz_s: list[float] = []
    pz_e: list[float] = []
    full_rate = speed / n_slices

    for te, kind in zip(times + [horizon_s], kinds + [2]):
        if paused and te >= pause_end:  # the pause ended before this event: resume
            paused = False
            joined = available if elastic else n_slices
            rec_start, rec_work0, last_commit_t = pause_end, committed, pause_end
            t = pause_end
        if not paused and te > t:  # compute over [t, te]: whole compute+snapshot cycles, then a partial one
            rate = full_rate * joined
            dt = te - t
            if cycle is None:
                committed += at_risk + rate * dt
                at_risk = 0.0
                last_commit_t = te
            else:
                total = pos + dt
                if total < cycle:
                    at_risk += rate * (min(total, interval_s) - min(pos, interval_s))
                    pos = total
                else:
                    k = int(total // cycle)
                    committed += at_risk + rate * (interval_s - min(pos, interval_s)) + rate * interval_s * (k - 1)
                    rest = total - k * cycle
                    at_risk = rate * min(rest, interval_s)
                    last_commit_t = t + k * cycle - pos
                    pos = rest
        t = te
        if kind == 2:  # the end of the span: nothing interrupts the work in flight
            committed += at_risk
            if not paused:
                adv_s.append(rec_start)
                adv_e.append(te)
                adv_w.append(committed - rec_work0)
            elif adv_w:
                adv_w[-1] += at_risk
            break
        if kind == 0:  # interruption: roll back to the last snapshot
            available -= 1
            lost += at_risk
            at_risk = 0.0
            pos = 0.0
            pause = fail_pause_s
        else:  # a slice is back
            available += 1
            pause = upscale_s
        if not paused:
            adv_s.append(rec_start)
            adv_e.append(max(rec_start, last_commit_t))
            adv_w.append(committed - rec_work0)
            paused, pause_end = True, te + pause
            pz_s.append(te)
            pz_e.append(min(pause_end, horizon_s))

    return GroupTimeline(
        kept_work=committed,
        lost_work=lost,
        adv_start=np.asarray(adv_s),
        adv_end=np.asarray(adv_e),
        adv_work=np.asarray(adv_w),
        pause_start=np.asarray(pz_s),
        pause_end=np.asarray(pz_e),
        horizon_s=horizon_s,
    )

