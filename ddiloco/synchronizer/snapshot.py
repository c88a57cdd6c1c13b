"""What one synchronizer pass decides from, read from the ledger at its start: the learners (who is live, by
``platform.liveness``), the pending submissions by fragment, the newest versions, and the quorum and grace
window the policies give for them."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

from ddiloco.platform import liveness
from ddiloco.platform.config import RunConfig, tokens_per_step
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger import synchronizer as sync_q
from ddiloco.platform.ledger.models import FragmentVersion, Submission
from ddiloco.platform.runtime import RunContext, to_datetime
from ddiloco.synchronizer import policy as pol


@dataclass(frozen=True)
class PassPolicies:
    """The decisions a pass takes from its snapshot, as the run's config sets them."""

    liveness: liveness.LivenessPolicy
    quorum: pol.QuorumPolicy
    grace: pol.GracePolicy

    @classmethod
    def from_config(cls, cfg: RunConfig) -> PassPolicies:
        grace = pol.GracePolicy(
            enabled=cfg.grace.enabled,
            gamma=cfg.grace.gamma,
            overlap_steps=cfg.fragments.overlap,
            min_s=cfg.grace.min_s,
            max_s=cfg.grace.max_s,
        )
        return cls(liveness.LivenessPolicy.from_learners_config(cfg.learners),
                   pol.QuorumPolicy(cfg.quorum.min_count, cfg.quorum.min_fraction), grace)


@dataclass(frozen=True)
class Snapshot:
    """What one pass decides from, read from the ledger at its start."""

    regions: dict[str, str]
    """Region of every registered learner."""
    most_tokens: dict[str, int]
    """The most tokens one inner step of every registered learner trains: its recorded ranks' batches."""
    live: frozenset[str]
    pending: dict[int, list[Submission]]
    """Pending submissions by fragment, fragments in order."""
    latest: dict[int, FragmentVersion]
    quorum: int
    grace_s: float


def read_snapshot(
    ctx: RunContext, now: float, fragments: sync_q.FragmentFilter | None, policies: PassPolicies, stats: pol.TimingStats
) -> tuple[Snapshot, pol.TimingStats]:
    """Read learners, pending work (of ``fragments``; None: all) and versions; returns the snapshot and ``stats``
    with the live median step time folded in (the grace window is computed from those)."""
    cfg, run_id, now_dt = ctx.cfg, ctx.run_id, to_datetime(now)
    with ctx.reading() as s:
        rows = runs_q.learners(s, run_id)
        pending = sync_q.pending_submissions(s, run_id, fragments=fragments)
        latest = runs_q.latest_versions(s, run_id)
    snaps = runs_q.learner_snapshots(rows)
    live = frozenset(liveness.live_ids(liveness.learner_verdicts(snaps, now_dt, policies.liveness)))
    step_s = liveness.median_live_step_s(snaps, now_dt, policies.liveness)
    if step_s:
        stats = replace(stats, step_s=step_s)
    by_fragment: dict[int, list[Submission]] = defaultdict(list)
    for sub in pending:
        by_fragment[sub.fragment].append(sub)
    lc, batch = cfg.learners, cfg.learners.batch_size * cfg.inner.grad_accum_steps
    snap = Snapshot(
        regions={r.id: r.region for r in rows},
        # Per learner the ranks differ (the job's world size, recorded as it registered), within the run's limit.
        most_tokens={r.id: tokens_per_step(cfg.model, batch, pol.judged_ranks(r.world_size, lc.max_world_size)) for r in rows},
        live=live,
        pending=dict(sorted(by_fragment.items())),
        latest=latest,
        quorum=pol.quorum_size(policies.quorum, len(live)),
        grace_s=pol.grace_window(stats, policies.grace),
    )
    return snap, stats
