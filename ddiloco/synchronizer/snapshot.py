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
from ddiloco.synchronizer.validate import LearnerFacts


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
    learners: dict[str, LearnerFacts]
    """What the ledger says of every registered learner, to judge its submissions' claims by."""
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
        run = runs_q.get_run(s, run_id)
        rows = runs_q.learners(s, run_id)
        pending = sync_q.pending_submissions(s, run_id, fragments=fragments)
        latest = runs_q.latest_versions(s, run_id)
    snaps = runs_q.learner_snapshots(rows)
    verdicts = liveness.learner_verdicts(snaps, now_dt, policies.liveness)
    live = frozenset(liveness.live_ids(verdicts))
    step_s = liveness.median_live_step_s(snaps, now_dt, policies.liveness)
    if step_s:
        stats = replace(stats, step_s=step_s)
    by_fragment: dict[int, list[Submission]] = defaultdict(list)
    for sub in pending:
        by_fragment[sub.fragment].append(sub)
    lc, batch = cfg.learners, cfg.learners.batch_size * cfg.inner.grad_accum_steps
    snap = Snapshot(
        regions={r.id: r.region for r in rows},
        learners={
            r.id: LearnerFacts(
                # Per learner the ranks differ (the job's world size, recorded as it registered), within the run's limit.
                tokens_per_step(cfg.model, batch, pol.judged_ranks(r.world_size, lc.max_world_size)),
                # A learner's start is its own clock's claim: never earlier than the run's, and the liveness rule's
                # tolerance covers clocks that disagree.
                now - max(r.started_at.timestamp(), run.created_at.timestamp() if run else now) + policies.liveness.dead_after_s,
                None if verdicts[r.id].status != liveness.DEAD else verdicts[r.id].reason,
                None if verdicts[r.id].status != liveness.DEAD else liveness.dead_since(sn, policies.liveness).timestamp(),
            )
            for r, sn in zip(rows, snaps, strict=True)
        },
        live=live,
        pending=dict(sorted(by_fragment.items())),
        latest=latest,
        quorum=pol.quorum_size(policies.quorum, len(live)),
        grace_s=pol.grace_window(stats, policies.grace),
    )
    return snap, stats
