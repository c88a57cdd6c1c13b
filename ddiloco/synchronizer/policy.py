"""The synchronizer's decisions as pure functions of (now, snapshot, policy), each with its reason.

Times are plain float seconds on one clock; the caller passes ``now`` (real or simulated),
so tests and the goodput simulator move time by editing numbers, never by sleeping."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ddiloco.platform.config import CODECS


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


def budget_end(tokens_merged: int, token_budget: int) -> str | None:
    """Why the run is over by its token budget, or None while it goes on. Merged tokens, never trained ones: trained
    counts what learners claim, and a lying claim (rejected a poll later) must not end a run. Whoever drives the run
    (the synchronizer's loop, the training flow's supervisor) asks this one question."""
    if tokens_merged >= token_budget:
        return f"token budget reached: {tokens_merged:,} tokens merged of {token_budget:,}"
    return None


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


def judged_ranks(recorded: int | None, limit: int) -> int:
    """Ranks a learner's tokens per step are judged by: its world size as recorded when it registered, never more than
    the run's ``learners.max_world_size`` (a row from before world sizes were recorded: that limit)."""
    return limit if recorded is None else max(1, min(recorded, limit))


FASTEST_STEP_S = 1e-4
"""No inner step of any learner takes less: a forward, a backward and an AdamW step are dozens of kernels, each
microseconds to launch. A claim of more steps than the time its learner had allows at this pace is implausible."""


def check_claims(c_steps: int, c_tokens: int, tokens_new: int, base_version: int, tokens_per_step: int,
                 trained_s: float | None = None, codec: str | None = None) -> str | None:
    """A reason to reject what a submission says about itself, or None when it is plausible: the one judgement of
    its counts against each other, against its learner's registered ranks and batch, and against time.

    Counts are the merge's weights and the run's token accounting: a learner cannot have trained
    more tokens per step than its batch holds (``tokens_per_step``: batch x sequence x ranks x
    accumulation), more new tokens than the update carries, or more steps than ``trained_s`` (the longest it
    can have trained, by the synchronizer's reading of the ledger) holds at :data:`FASTEST_STEP_S` a step; no
    honest learner sends from before version 0 or in a codec the platform does not have. Steps within that
    bound are not judged here: they weigh at most ``merge.max_periods`` periods in the merge
    (:func:`capped_counts`)."""
    why = check_counts(c_steps, c_tokens)
    if why:
        return why
    if base_version < 0:
        return f"implausible claim: base version v{base_version} (the first published version is v0)"
    if tokens_new < 0 or tokens_new > c_tokens:
        return f"implausible claim: {tokens_new} new tokens in an update of {c_tokens} tokens"
    if c_tokens > c_steps * tokens_per_step:
        return (f"implausible claim: {c_tokens} tokens in {c_steps} steps, more than the "
                f"{tokens_per_step} one step of this learner's ranks trains")
    if trained_s is not None and c_steps > max(0.0, trained_s) / FASTEST_STEP_S:
        return (f"implausible claim: {c_steps} steps in the {max(0.0, trained_s):.4g}s its learner can have trained, "
                f"more than one every {FASTEST_STEP_S:g}s")
    if codec is not None and codec not in CODECS:
        return f"implausible claim: codec {codec[:24]!r}, none of {', '.join(CODECS)}"
    return None


ADAM_STEP_SLACK = 4.0
"""An AdamW step moves a coordinate by at most about lr (|m_hat / sqrt(v_hat)| <= 1 while beta1^2 <
beta2); a send after a blended receipt also carries part of the distance to the global version,
about one period's steps more. 4 leaves room for both: honest per-step norms sit far below."""


def plausible_step_norm(lr: float, weight_decay: float, numel: int, param_norm: float) -> float:
    """The largest norm of one inner step's change of a fragment that AdamW at ``lr`` can make."""
    return ADAM_STEP_SLACK * lr * math.sqrt(max(1, numel)) + lr * weight_decay * param_norm


def capped_counts(c_steps: int, c_tokens: int, max_steps: int | None) -> tuple[int, int]:
    """A learner's (c_tokens, c_steps) for its merge weight, its steps capped at ``max_steps`` and its
    tokens scaled alike: the token-weight formula rewards honest speed; it is no lever for a claim
    (w = c_tokens^2 / c_steps grows with the steps claimed). Returned as (c_tokens, c_steps)."""
    if max_steps is None or c_steps <= max_steps:
        return c_tokens, c_steps
    return max(1, c_tokens * max_steps // c_steps), max_steps


def norm_steps(c_steps: int, max_steps: int) -> int:
    """The steps a norm is judged over: the claim, but never more than ``max_steps``, the most a learner's steps weigh
    in the merge (``merge.max_periods`` periods: claiming more buys no room under the norm bars). Not one period: a
    learner whose uploads stalled sends the sum of several periods' steps, and AdamW moves it further with each."""
    return max(1, min(c_steps, max_steps))


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


MIN_NORM_HISTORY = 4
"""Merged norms a fragment needs before its recent history is the yardstick (outlier check, clipping)."""


def check_norm(norm: float, recent_norms: Sequence[float], factor: float, min_history: int = MIN_NORM_HISTORY,
               plausible: float | None = None, raw: tuple[float, Sequence[float]] | None = None,
               plausible_whole: float | None = None) -> str | None:
    """Reject a per-step norm far above every recently merged one, or, until there is a history,
    above what the inner optimizer can make (``plausible``, from :func:`plausible_step_norm`) unless it is
    within ``plausible_whole`` in all.

    The largest recent norm, not the median, is the yardstick: norms grow several-fold per
    version during learning-rate warm-up, and only a blow-up should be refused. With ``raw`` (the
    update's own norm and the recent ones'), an outlier must stand out both per step and whole: a
    send soon after a blended receipt has a small c_steps yet carries part of the distance to the
    new version (large per step, ordinary whole), and a fragment's first sends cover fewer steps
    than the later ones (ordinary per step, larger whole).

    Such sends, and a long stall's increment, raise the recent maxima above what any inner step can move; no yardstick
    counts above ``plausible`` per step or ``plausible_whole`` in all (the most steps the merge weighs), so that
    updates outsized together cannot ride on them."""
    if len(recent_norms) < min_history:
        if plausible is None or norm <= plausible:
            return None
        if raw is not None and plausible_whole is not None and raw[0] <= plausible_whole:
            # A send soon after a blended receipt before the history exists: it carries part of the outer step, which
            # Nesterov's momentum makes several periods long, on few steps; in all it is no more than the merge weighs.
            return None
        return f"norm outlier: {norm:.4g} per step > {plausible:.4g}, the most an inner step at this run's lr can move"
    largest, name = _yardstick(max(recent_norms), plausible)
    if not (largest > 0 and norm > factor * largest):
        return None
    if raw is not None and raw[1]:
        whole, (recent_whole, whole_name) = raw[0], _yardstick(max(raw[1]), plausible_whole)
        if recent_whole > 0 and whole <= factor * recent_whole:
            return None
        return (f"norm outlier: {norm:.4g} per step > {factor:g} x {name} {largest:.4g}, "
                f"and {whole:.4g} in all > {factor:g} x {whole_name} {recent_whole:.4g}")
    return f"norm outlier: {norm:.4g} > {factor:g} x {name} {largest:.4g}"


def _yardstick(recent_max: float, bound: float | None) -> tuple[float, str]:
    """The recent maximum, or the optimizer's bound where that is lower; named as the rejection reason says it."""
    if bound is not None and bound < recent_max:
        return bound, "the optimizer's bound"
    return recent_max, "recent max"
