"""A run's headline figures, computed from the ledger alone (CLI summary, dashboard, flows)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ddiloco.platform.ledger import queries as q
from ddiloco.platform.ledger.models import FragmentSpec, FragmentVersion, Submission

DP_BYTES_PER_PARAM = 4
"""Data-parallel baseline: every replica sends a float32 gradient of every parameter each step."""


@dataclass(frozen=True)
class RunSummary:
    run: str
    status: str
    tokens: int
    tokens_merged: int
    tokens_rejected: int
    tokens_pending: int
    tokens_lost: int
    tokens_in_flight: int
    accounting_balanced: bool
    versions: dict[int, int]
    val_loss_start: float | None
    val_loss_end: float | None
    val_accuracy_end: float | None
    goodput: float
    longest_version_gap_s: float
    bytes_sent: int
    bytes_data_parallel: int
    rejected_by_reason: dict[str, int]
    submissions: int
    learners: int
    wall_s: float

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)


def _reason_class(reason: str | None) -> str:
    """Group reasons by their first words ('stale: based on v3 …' -> 'stale')."""
    if not reason:
        return "unknown"
    head = reason.split(":", 1)[0]
    return head if len(head) <= 48 else head[:48]


def longest_gap_s(times: list[datetime], start: datetime, end: datetime) -> float:
    """Longest stretch in [start, end] with no new global version."""
    points = sorted([start, *[t for t in times if start <= t <= end], end])
    return max(((b - a).total_seconds() for a, b in zip(points, points[1:])), default=0.0)


def run_summary(session: Session, run_id: str, now: datetime, *, tokens_per_step: int | None = None) -> RunSummary:
    run = q.require_run(session, run_id)
    acct = q.token_accounting(session, run_id)
    versions = q.latest_version_numbers(session, run_id)
    evals = q.evaluations(session, run_id)
    learners = q.learners(session, run_id)
    end = run.finished_at or now
    wall = max(1e-9, (end - run.created_at).total_seconds())
    merged_times = list(
        session.scalars(select(FragmentVersion.created_at).where(FragmentVersion.run_id == run_id, FragmentVersion.version > 0))
    )
    # Downtime is counted from the first merge: before it, learners are still starting up.
    gap = longest_gap_s(merged_times, min(merged_times), end) if merged_times else 0.0
    bytes_sent = int(session.scalar(select(func.coalesce(func.sum(Submission.nbytes), 0)).where(Submission.run_id == run_id)) or 0)
    reasons = Counter(
        _reason_class(r)
        for r in session.scalars(select(Submission.reject_reason).where(Submission.run_id == run_id, Submission.status == "rejected"))
    )
    numel = int(session.scalar(select(func.coalesce(func.sum(FragmentSpec.numel), 0)).where(FragmentSpec.run_id == run_id)) or 0)
    cfg = json.loads(run.config_json) if run.config_json else {}
    if tokens_per_step is None:
        try:
            tokens_per_step = int(cfg["learners"]["batch_size"]) * int(cfg["model"]["seq_len"])
        except (KeyError, TypeError, ValueError):
            tokens_per_step = 1
    steps = acct.trained / max(1, tokens_per_step)
    busy = sum(l.busy_s for l in learners)
    allocated = wall * max(1, len(learners))
    merged_share = acct.merged / acct.trained if acct.trained else 0.0
    goodput = merged_share * min(1.0, busy / allocated) if allocated > 0 else 0.0
    n_subs = int(session.scalar(select(func.count()).select_from(Submission).where(Submission.run_id == run_id)) or 0)
    return RunSummary(
        run=run_id,
        status=run.status,
        tokens=acct.trained,
        tokens_merged=acct.merged,
        tokens_rejected=acct.rejected,
        tokens_pending=acct.pending,
        tokens_lost=acct.lost,
        tokens_in_flight=acct.in_flight,
        accounting_balanced=acct.balanced,
        versions=versions,
        val_loss_start=evals[0].val_loss if evals else None,
        val_loss_end=evals[-1].val_loss if evals else None,
        val_accuracy_end=evals[-1].val_accuracy if evals else None,
        goodput=goodput,
        longest_version_gap_s=gap,
        bytes_sent=bytes_sent,
        bytes_data_parallel=int(steps * numel * DP_BYTES_PER_PARAM),
        rejected_by_reason=dict(reasons),
        submissions=n_subs,
        learners=len(learners),
        wall_s=wall,
    )
