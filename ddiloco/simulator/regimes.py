"""The four regimes over one failure trace, and the decoupled synchronizer driven by the real policy.

Goodput: share of allocated chip-time whose work reached the global model.
Uptime: share of wall time during which the global model advanced (for the learner regimes: at
least K learners were computing work that reached it, K from the synchronizer's quorum).
Bound: share of chip-time the chips were up (the same physical trace for every regime)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ddiloco.simulator.config import REGIMES, Regime, SimulationConfig
from ddiloco.simulator.failures import FailureTrace, draw_failures, slice_count
from ddiloco.simulator.group import (
    GroupTimeline,
    Trajectory,
    run_group,
    snapshot_interval,
    straggler_speed,
)
from ddiloco.synchronizer import policy


@dataclass(frozen=True)
class Row:
    regime: Regime
    learners: int
    chips: int
    goodput: float
    uptime: float
    bound: float

    def to_dict(self) -> dict:
        return {
            "regime": self.regime,
            "learners": self.learners,
            "chips": self.chips,
            "goodput": self.goodput,
            "uptime": self.uptime,
            "bound": self.bound,
        }


@dataclass(frozen=True)
class RegimeResult:
    row: Row
    details: dict = field(default_factory=dict)
    """Extra figures: failures, lost work, merges, longest wait between two global versions."""


# --- groups -----------------------------------------------------------------------------------------


def _elastic_learners(
    cfg: SimulationConfig, trace: FailureTrace, learners: int, coupled: bool = False
) -> list[tuple[GroupTimeline, float]]:
    """Each learner is an elastic data-parallel job over its share of the slices: (timeline, chips).

    Snapshots follow Young's rule for the failure rate whose rollbacks the run pays for: the
    learner's own when learners are independent, the whole cluster's when they are ``coupled`` by
    a barrier (synchronous DiLoCo: any learner's rollback holds every learner back)."""
    out = []
    for times, n_slices in trace.split(learners):
        chips = n_slices * trace.chips_per_slice
        blast = trace.chips if coupled else chips
        interval = snapshot_interval(cfg.checkpoint_s, cfg.checkpoint_interval_s, cfg.mtbi_s / blast)
        tl = run_group(
            times,
            n_slices=n_slices,
            horizon_s=trace.horizon_s,
            elastic=True,
            repair_s=trace.repair_s,
            fail_pause_s=cfg.downscale_s,
            upscale_s=cfg.upscale_s,
            checkpoint_s=cfg.checkpoint_s,
            interval_s=interval,
            speed=straggler_speed(chips, cfg.chip_speed_cv),
        )
        out.append((tl, chips))
    return out


def _row(regime: Regime, learners: int, trace: FailureTrace, goodput: float, uptime: float) -> Row:
    uptime = min(1.0, max(0.0, uptime))
    return Row(regime, learners, int(round(trace.chips)), float(goodput), float(uptime), trace.bound())


def simulate_dp(cfg: SimulationConfig, trace: FailureTrace) -> RegimeResult:
    """One synchronous job on all slices; every interruption is a restart from the last checkpoint."""
    interval = snapshot_interval(cfg.checkpoint_s, cfg.checkpoint_interval_s, cfg.mtbi_s / trace.chips)
    tl = run_group(
        trace.times,
        n_slices=trace.n_slices,
        horizon_s=trace.horizon_s,
        elastic=False,
        repair_s=trace.repair_s,
        fail_pause_s=cfg.restart_s,
        upscale_s=0.0,
        checkpoint_s=cfg.checkpoint_s,
        interval_s=interval,
        speed=straggler_speed(trace.chips, cfg.chip_speed_cv),
    )
    T = trace.horizon_s
    return RegimeResult(
        _row("dp", 1, trace, tl.kept_work / T, tl.advancing_s / T),
        {"failures": len(trace.times), "lost_share": tl.lost_work / T, "checkpoint_every_s": interval},
    )


def simulate_dp_elastic(cfg: SimulationConfig, trace: FailureTrace, timelines=None) -> RegimeResult:
    """The same job with slice elasticity: one elastic group over all slices."""
    ((tl, _),) = timelines or _elastic_learners(cfg, trace, 1)
    T = trace.horizon_s
    return RegimeResult(
        _row("dp_elastic", 1, trace, tl.kept_work / T, tl.advancing_s / T),
        {"failures": len(trace.times), "lost_share": tl.lost_work / T},
    )


def simulate_diloco_sync(cfg: SimulationConfig, trace: FailureTrace, learners: int, timelines=None) -> RegimeResult:
    """M elastic learners that all finish H inner steps, then sync together (a barrier per round).

    Each learner's capacity over time (pauses, lost slices, rollbacks) is its own; a round ends when
    the slowest learner has done a round of work since the last barrier, plus the outer all-reduce.
    Learners that finish early idle: their chip-time is lost."""
    groups = timelines or _elastic_learners(cfg, trace, learners, coupled=True)
    T, W, sync = trace.horizon_s, cfg.round_s, cfg.outer_sync_s
    trajs = [tl.trajectory() for tl, _ in groups]

    def done_by(t: float) -> np.ndarray:
        return np.array([tr.at(t) for tr in trajs])

    def reach(w: np.ndarray) -> np.ndarray:
        return np.array([tr.time_of(x) for tr, x in zip(trajs, w.tolist())])

    end, rounds, down, longest = 0.0, 0, 0.0, 0.0
    done_at_end = done_by(end)
    while True:
        finish = float(reach(done_at_end + W).max()) + sync
        if finish > T:
            break
        down += max(0.0, finish - end - (W + sync))
        longest = max(longest, finish - end)
        end, rounds = finish, rounds + 1
        done_at_end = done_by(end)
    partial = np.minimum(W, done_by(T) - done_at_end).tolist()
    down += max(0.0, (T - end) - min(partial))  # the last, unfinished round is merged at the end
    chips = [c for _, c in groups]
    goodput = sum((rounds * W + p) * c for p, c in zip(partial, chips)) / (trace.chips * T)
    return RegimeResult(
        _row("diloco_sync", learners, trace, goodput, 1.0 - down / T),
        {"rounds": rounds, "longest_round_s": longest},
    )


# --- the decoupled synchronizer ---------------------------------------------------------------------


@dataclass
class SynchronizerRun:
    merged_work: list[float]
    merge_times: list[float]
    unmerged_work: float
    decisions: int


class _Liveness:
    """The set of live learners (not inside a recovery pause), swept forward in time."""

    def __init__(self, timelines: Sequence[GroupTimeline], ids: Sequence[str]):
        t = np.concatenate([np.concatenate([tl.pause_start, tl.pause_end]) for tl in timelines] + [np.zeros(0)])
        who = np.concatenate(
            [np.full(2 * len(tl.pause_start), m) for m, tl in enumerate(timelines)] + [np.zeros(0, int)]
        )
        back = np.concatenate([np.repeat([False, True], len(tl.pause_start)) for tl in timelines] + [np.zeros(0, bool)])
        order = np.argsort(t, kind="stable")
        self.t, self.who, self.back = t[order].tolist(), who[order].tolist(), back[order].tolist()
        self.ids = list(ids)
        self.live = set(ids)
        self.k = 0

    def at(self, now: float) -> set[str]:
        """Live learners at ``now``; calls must come in non-decreasing time."""
        t, k = self.t, self.k
        if k >= len(t) or t[k] > now:  # nothing changed since the last call (the common case)
            return self.live
        while k < len(t) and t[k] <= now:
            if self.back[k]:
                self.live.add(self.ids[self.who[k]])
            else:
                self.live.discard(self.ids[self.who[k]])
            k += 1
        self.k = k
        return self.live


def run_synchronizer(
    cfg: SimulationConfig,
    sub_times: np.ndarray,
    sub_learners: np.ndarray,
    sub_work: np.ndarray,
    liveness: _Liveness,
    learners: int,
    observed_step_s: float,
) -> SynchronizerRun:
    """Replay the submissions through the synchronizer's own decisions (quorum, grace, merge).

    Decisions are taken when a submission arrives and when a grace window closes, with
    ``policy.decide_merge``; K comes from ``policy.quorum_size`` over the live learners and the
    window from ``policy.grace_window`` over moving averages kept with ``policy.update_stats``."""
    qp, gp = cfg.quorum_policy(), cfg.grace_policy()
    ids = liveness.ids
    stats = policy.TimingStats()
    pending: list[policy.PendingEntry] = []
    pending_work: list[tuple[int, float]] = []
    merged = [0.0] * learners
    merge_times: list[float] = []
    decisions = 0
    wait_until: float | None = None

    # quorum_size depends only on the live count and grace_window only on the averages: evaluate
    # them once per count / per update (the same functions, called less often).
    k_of_live = [policy.quorum_size(qp, n) for n in range(learners + 1)]
    grace = policy.grace_window(stats, gp)

    def decide(now: float) -> policy.MergeDecision:
        nonlocal decisions
        decisions += 1
        live = liveness.at(now)
        return policy.decide_merge(now, pending, live, k_of_live[len(live)], grace, gp.enabled)

    def settle(now: float, d: policy.MergeDecision) -> None:
        nonlocal stats, wait_until, grace
        if not d.merge:
            wait_until = d.wait_until
            return
        first = min(p.created_at for p in pending)
        quorum_s = (d.quorum_reached_at - first) if d.quorum_reached_at is not None else 0.0
        for m, w in pending_work:
            merged[m] += w
        stats = policy.update_stats(
            stats, cfg.grace.ema, step_s=observed_step_s, quorum_s=quorum_s, sync_s=cfg.outer_sync_s
        )
        grace = policy.grace_window(stats, gp)
        pending.clear()
        pending_work.clear()
        merge_times.append(now)
        wait_until = None

    for t, m, w in zip(sub_times.tolist(), sub_learners.tolist(), sub_work.tolist()):
        if wait_until is not None and wait_until <= t:
            at = wait_until
            settle(at, decide(at))
        pending.append(policy.PendingEntry(ids[m], t))
        pending_work.append((m, w))
        settle(t, decide(t))
    # After the last (end-of-span) submissions: let an open grace window close; a quorum that can
    # no longer be reached leaves its work unmerged.
    while pending and wait_until is not None:
        at = wait_until
        settle(at, decide(at))
    return SynchronizerRun(merged, merge_times, float(sum(w for _, w in pending_work)), decisions)


def _submissions(trajs: Sequence[Trajectory], round_work: float, horizon_s: float):
    """One submission per round of kept work per learner, plus each learner's remainder at the end."""
    times, who, work = [], [], []
    for m, tr in enumerate(trajs):
        full = int(tr.total // round_work)
        if full:
            t = tr.times_of(round_work * np.arange(1, full + 1))
            times.append(np.minimum(t, horizon_s))
            who.append(np.full(full, m))
            work.append(np.full(full, round_work))
        rest = tr.total - full * round_work
        if rest > 1e-9:
            times.append(np.array([horizon_s]))
            who.append(np.array([m]))
            work.append(np.array([rest]))
    if not times:
        return np.zeros(0), np.zeros(0, dtype=int), np.zeros(0)
    t, m, w = np.concatenate(times), np.concatenate(who), np.concatenate(work)
    order = np.lexsort((m, t))
    return t[order], m[order], w[order]


def _quorum_uptime(cfg: SimulationConfig, timelines: Sequence[GroupTimeline], horizon_s: float) -> float:
    """Share of time at least K learners compute work that reaches the model, K = quorum_size(live)."""
    learners = len(timelines)
    t_parts, adv_parts, live_parts = [np.array([0.0])], [np.array([0])], [np.array([0])]
    for tl in timelines:
        ok = tl.adv_work > 0
        s, e = tl.adv_start[ok], tl.adv_end[ok]
        t_parts += [s, e, tl.pause_start, tl.pause_end]
        n_adv, n_pause = len(s), len(tl.pause_start)
        adv_parts += [np.ones(n_adv, int), -np.ones(n_adv, int), np.zeros(n_pause, int), np.zeros(n_pause, int)]
        live_parts += [np.zeros(n_adv, int), np.zeros(n_adv, int), -np.ones(n_pause, int), np.ones(n_pause, int)]
    t = np.concatenate(t_parts)
    order = np.argsort(t, kind="stable")
    t = t[order]
    adv = np.cumsum(np.concatenate(adv_parts)[order])
    live = learners + np.cumsum(np.concatenate(live_parts)[order])
    dur = np.diff(np.append(np.minimum(t, horizon_s), horizon_s))
    qp = cfg.quorum_policy()
    k_of_live = np.array([policy.quorum_size(qp, n) for n in range(learners + 1)])
    return float(dur[adv >= k_of_live[np.clip(live, 0, learners)]].sum() / horizon_s)


def simulate_decoupled(cfg: SimulationConfig, trace: FailureTrace, learners: int, timelines=None) -> RegimeResult:
    """M elastic learners that never wait; their rounds are merged by the synchronizer's policy."""
    groups = timelines or _elastic_learners(cfg, trace, learners)
    tls = [tl for tl, _ in groups]
    chips = [c for _, c in groups]
    T = trace.horizon_s
    sub_t, sub_m, sub_w = _submissions([tl.trajectory() for tl in tls], cfg.round_s, T)
    speed = straggler_speed(trace.chips / learners, cfg.chip_speed_cv)
    ids = [f"learner-{m}" for m in range(learners)]
    run = run_synchronizer(cfg, sub_t, sub_m, sub_w, _Liveness(tls, ids), learners, cfg.step_s / speed)
    goodput = sum(w * c for w, c in zip(run.merged_work, chips)) / (trace.chips * T)
    gaps = np.diff(np.concatenate([[0.0], run.merge_times])) if run.merge_times else np.array([T])
    return RegimeResult(
        _row("decoupled", learners, trace, goodput, _quorum_uptime(cfg, tls, T)),
        {
            "merges": len(run.merge_times),
            "submissions": int(len(sub_t)),
            "policy_decisions": run.decisions,
            "longest_gap_between_versions_s": float(gaps.max()),
            "unmerged_share": run.unmerged_work / (learners * T),
        },
    )


# --- a whole cluster size ---------------------------------------------------------------------------


def trace_for(cfg: SimulationConfig, chips: float, max_learners: int = 1) -> FailureTrace:
    n_slices = slice_count(chips, cfg.slice_chips, max_learners)
    return draw_failures(
        chips, n_slices=n_slices, mtbi_s=cfg.mtbi_s, horizon_s=cfg.horizon_s, repair_s=cfg.repair_s, seed=cfg.seed
    )


def simulate_cluster(
    cfg: SimulationConfig,
    chips: float,
    learners: Sequence[int] = (1, 2, 4, 8, 16),
    regimes: Sequence[Regime] = REGIMES,
    trace: FailureTrace | None = None,
) -> list[RegimeResult]:
    """Every requested regime at one cluster size, over one shared failure trace.

    dp and dp_elastic are one row each (learners = 1); diloco_sync and decoupled one row per M."""
    for r in regimes:
        if r not in REGIMES:
            raise ValueError(f"unknown regime {r!r}; choose from {', '.join(REGIMES)}")
    learners = sorted(set(int(m) for m in learners))
    if not learners or learners[0] < 1:
        raise ValueError("learners must be positive integers")
    min_count = cfg.quorum.min_count if cfg.quorum.min_fraction is None else None
    if min_count is not None and min_count > learners[0] and ({"decoupled"} & set(regimes)):
        raise ValueError(f"quorum.min_count ({min_count}) exceeds the smallest learner count ({learners[0]})")
    if not {"diloco_sync", "decoupled"} & set(regimes):
        learners = [1]  # the data-parallel regimes have no learners to split into
    trace = trace or trace_for(cfg, chips, max(learners))
    if trace.n_slices < max(learners):
        raise ValueError(f"{trace.n_slices} slices cannot be split into {max(learners)} learners")
    out: list[RegimeResult] = []
    elastic_cache: dict[int, list] = {}

    def elastic(m: int, coupled: bool = False):
        if m == 1 or not coupled:  # one learner: coupled or not is the same group
            if m not in elastic_cache:
                elastic_cache[m] = _elastic_learners(cfg, trace, m)
            return elastic_cache[m]
        return _elastic_learners(cfg, trace, m, coupled=True)

    if "dp" in regimes:
        out.append(simulate_dp(cfg, trace))
    if "dp_elastic" in regimes:
        out.append(simulate_dp_elastic(cfg, trace, elastic(1)))
    for m in learners:
        if "diloco_sync" in regimes:
            out.append(simulate_diloco_sync(cfg, trace, m, elastic(m, coupled=True)))
        if "decoupled" in regimes:
            out.append(simulate_decoupled(cfg, trace, m, elastic(m)))
        if m != 1:
            elastic_cache.pop(m, None)  # keep memory flat; M = 1 is shared with dp_elastic
    return out


def simulate_table(
    cfg: SimulationConfig,
    chips: Sequence[float],
    learners: Sequence[int] = (1, 2, 4, 8, 16),
    regimes: Sequence[Regime] = REGIMES,
) -> list[RegimeResult]:
    """The whole grid: every cluster size, every regime, every learner count."""
    out: list[RegimeResult] = []
    for n in chips:
        out.extend(simulate_cluster(cfg, n, learners, regimes))
    return out
