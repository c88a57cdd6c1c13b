"""The synchronizer's decisions as pure functions of (now, snapshot, policy), each with its reason.

Times are plain float seconds on one clock; the caller passes ``now`` (real or simulated),
so tests and the goodput simulator move time by editing numbers, never by sleeping."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class QuorumPolicy:
    min_count: int | None = 1
    min_fraction: float | None = None


@dataclass(frozen=True)
class GracePolicy:
    enabled: bool = True
    gamma: float = 0.8
    overlap_steps: int = 2
    min_s: float = 0.0
    max_s: float | None = 5.0


@dataclass(frozen=True)
class TimingStats:
    """Moving averages the grace window is computed from (None until first observed)."""

    step_s: float | None = None
    quorum_s: float | None = None
    sync_s: float | None = None


@dataclass(frozen=True)
class PendingEntry:
    learner_id: str
    created_at: float


@dataclass(frozen=True)
class MergeDecision:
    merge: bool
    reason: str
    quorum: int
    grace_s: float
    quorum_reached_at: float | None = None
    wait_until: float | None = None
    """When a waiting decision can next change by itself (end of the grace window)."""


def quorum_size(policy: QuorumPolicy, live_learners: int) -> int:
    """K: a fixed count, or a fraction of the live learners rounded up (at least 1)."""
    if policy.min_fraction is not None:
        return max(1, math.ceil(policy.min_fraction * live_learners - 1e-9))
    return max(1, policy.min_count or 1)


def ema(previous: float | None, sample: float, alpha: float) -> float:
    return sample if previous is None else (1 - alpha) * previous + alpha * sample


def update_stats(stats: TimingStats, alpha: float, *, step_s: float | None = None, quorum_s: float | None = None,
                 sync_s: float | None = None) -> TimingStats:
    """Fold new observations into the moving averages."""
    return TimingStats(
        step_s=stats.step_s if step_s is None else ema(stats.step_s, step_s, alpha),
        quorum_s=stats.quorum_s if quorum_s is None else ema(stats.quorum_s, quorum_s, alpha),
        sync_s=stats.sync_s if sync_s is None else ema(stats.sync_s, sync_s, alpha),
    )


def grace_window(stats: TimingStats, policy: GracePolicy) -> float:
    """xi_grace = gamma * (tau * xi_step - xi_quorum - xi_sync), clamped to [min_s, max_s].

    The budget is what is left of the tau steps a learner may run past a send, once reaching
    quorum and merging have taken their share; before any step time is known it is min_s."""
    if not policy.enabled:
        return 0.0
    if stats.step_s is None:
        raw = policy.min_s
    else:
        raw = policy.gamma * (policy.overlap_steps * stats.step_s - (stats.quorum_s or 0.0) - (stats.sync_s or 0.0))
    raw = max(policy.min_s, raw)
    if policy.max_s is not None:
        raw = min(policy.max_s, raw)
    return raw


def quorum_time(pending: Sequence[PendingEntry], k: int) -> float | None:
    """When the k-th distinct learner's first pending submission arrived (None if fewer than k)."""
    first: dict[str, float] = {}
    for p in pending:
        if p.learner_id not in first or p.created_at < first[p.learner_id]:
            first[p.learner_id] = p.created_at
    times = sorted(first.values())
    return times[k - 1] if len(times) >= k else None


def decide_merge(
    now: float,
    pending: Sequence[PendingEntry],
    live_learners: Iterable[str],
    quorum: int,
    grace_s: float,
    grace_enabled: bool = True,
) -> MergeDecision:
    """Merge a fragment now, or wait: quorum first, then the grace window for stragglers."""
    submitters = {p.learner_id for p in pending}
    live = set(live_learners)
    n = len(submitters)
    if n == 0:
        return MergeDecision(False, "no pending submissions", quorum, grace_s)
    t_q = quorum_time(pending, quorum)
    if t_q is None:
        return MergeDecision(False, f"waiting for quorum: {n}/{quorum} learners submitted", quorum, grace_s)
    if live and live <= submitters:
        return MergeDecision(True, f"every live learner submitted ({n}/{len(live)})", quorum, grace_s, t_q)
    if not grace_enabled or grace_s <= 0:
        return MergeDecision(True, f"quorum reached ({n}/{quorum}), no grace window", quorum, grace_s, t_q)
    deadline = t_q + grace_s
    if now >= deadline:
        return MergeDecision(
            True, f"grace window of {grace_s:.2f}s closed with {n}/{max(len(live), n)} learners", quorum, grace_s, t_q
        )
    return MergeDecision(
        False,
        f"in grace window: {n}/{max(len(live), n)} learners, {deadline - now:.2f}s left",
        quorum,
        grace_s,
        t_q,
        wait_until=deadline,
    )


# --- validation and weights -------------------------------------------------------------------


def token_weight(c_tokens: int, c_steps: int, scheme: str = "tokens") -> float:
    """w = c_tokens * (c_tokens / c_steps): quantity times quality (tokens per step)."""
    if scheme == "equal":
        return 1.0
    if scheme != "tokens":
        raise ValueError(f"merge.weighting must be 'tokens' or 'equal', got {scheme!r}")
    return float(c_tokens) * (float(c_tokens) / float(c_steps))


def participation_scale(included: int, live: int) -> float:
    """Share of a full outer step a merge of ``included`` of ``live`` learners takes.

    Synchronous DiLoCo takes one step per round with every learner in it; when K < M merges
    happen several times a round with fewer learners each, and without this scale the outer
    learning rate would in effect grow with the number of merges per round."""
    if live <= 0:
        return 1.0
    return min(1.0, included / live)


def check_counts(c_steps: int, c_tokens: int) -> str | None:
    if c_steps <= 0 or c_tokens <= 0:
        return f"empty update: c_steps={c_steps}, c_tokens={c_tokens}"
    return None


def check_staleness(current_version: int, base_version: int, max_staleness: int) -> str | None:
    if base_version > current_version:
        return f"base version v{base_version} is newer than the published v{current_version}"
    stale = current_version - base_version
    if stale > max_staleness:
        return f"stale: based on v{base_version}, {stale} versions behind v{current_version} (max {max_staleness})"
    return None


def check_finite(norm: float) -> str | None:
    if not math.isfinite(norm):
        return "non-finite values (NaN or Inf) in the update"
    return None


def check_norm(norm: float, recent_norms: Sequence[float], factor: float, min_history: int = 4) -> str | None:
    """Reject a norm far above every recently merged norm (once there is a history).

    The largest recent norm, not the median, is the yardstick: norms grow several-fold per
    version during learning-rate warm-up, and only a blow-up should be refused."""
    if len(recent_norms) < min_history:
        return None
    largest = max(recent_norms)
    if largest > 0 and norm > factor * largest:
        return f"norm outlier: {norm:.4g} > {factor:g} x recent max {largest:.4g}"
    return None
