"""What reports read: the token accounting, a run's aggregates for its summary, each learner's timeline, and the full
scan ``ledger check`` holds the running totals to. The dashboard's other reads (tables, timelines, curves) are in
``ledger.dashboard``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ddiloco.platform import liveness
from ddiloco.platform.ledger.models import (
    MERGED,
    PENDING,
    REJECTED,
    Evaluation,
    Event,
    FragmentHead,
    FragmentSpec,
    Heartbeat,
    Learner,
    RejectionTotal,
    Run,
    Submission,
)
from ddiloco.platform.ledger.runs import (
    LEARNER_EXITED,
    LEARNER_JOINED,
    LEARNER_LAUNCHED,
    LEARNER_RESTARTED,
    learners,
    recorded_config,
    require_run,
    tokens_merged,
)

# --- accounting -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenAccounting:
    trained: int
    merged: int
    rejected: int
    pending: int
    lost: int
    in_flight: int
    """Trained by live learners and not yet submitted."""

    @property
    def balanced(self) -> bool:
        return self.trained == self.merged + self.rejected + self.pending + self.lost + self.in_flight


def account_tokens(rows: Iterable[Learner], tokens_by_status: dict[str, int]) -> TokenAccounting:
    """Where every trained token went: merged, rejected, pending, lost with a dead learner, or in flight."""
    trained = lost = in_flight = 0
    for r in rows:
        unsubmitted = max(0, r.inc_tokens_trained - r.inc_tokens_submitted)
        trained += r.tokens_trained + r.inc_tokens_trained
        lost += r.tokens_lost
        if r.status == liveness.DEAD:
            lost += unsubmitted
        else:
            in_flight += unsubmitted
    return TokenAccounting(
        trained=int(trained),
        merged=int(tokens_by_status.get(MERGED, 0)),
        rejected=int(tokens_by_status.get(REJECTED, 0)),
        pending=int(tokens_by_status.get(PENDING, 0)),
        lost=int(lost),
        in_flight=int(in_flight),
    )


def decided_tokens(session: Session, run_id: str) -> dict[str, int]:
    """Tokens by fate from running totals and a small set: merged from the fragment heads, rejected from the
    run's row, pending summed over just the pending rows (the poll index) — never every submission."""
    merged = tokens_merged(session, run_id)
    pending = session.scalar(
        select(func.coalesce(func.sum(Submission.tokens_new), 0)).where(Submission.run_id == run_id, Submission.status == PENDING)
    )
    rejected = session.scalar(select(Run.tokens_rejected).where(Run.id == run_id))
    return {MERGED: merged, PENDING: int(pending or 0), REJECTED: int(rejected or 0)}


def token_accounting(session: Session, run_id: str) -> TokenAccounting:
    """:func:`account_tokens` of the run as the ledger holds it now (cost independent of the run's history)."""
    return account_tokens(learners(session, run_id), decided_tokens(session, run_id))


def scanned_tokens(session: Session, run_id: str) -> dict[str, int]:
    """Tokens by fate summed over every submission: the full scan the running totals must equal (``ledger check``)."""
    rows = session.execute(
        select(Submission.status, func.coalesce(func.sum(Submission.tokens_new), 0))
        .where(Submission.run_id == run_id)
        .group_by(Submission.status)
    ).all()
    return {status: int(n) for status, n in rows}


# --- a run's aggregates ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RunAggregates:
    """The figures a run's summary is computed from (``platform.summary.summarize``), as the ledger holds them."""

    run: str
    status: str
    created_at: datetime
    finished_at: datetime | None
    config: dict[str, Any]
    """The run's recorded config (empty when it cannot be read)."""
    tokens: TokenAccounting
    versions: dict[int, int]
    """Newest global version of each fragment."""
    longest_merge_gap_s: float
    """Longest wait between two consecutive merged versions (version > 0, any fragments)."""
    last_merged_at: datetime | None
    """When the newest merged version was published (None before the first merge)."""
    val_loss_start: float | None
    val_loss_end: float | None
    val_accuracy_end: float | None
    submissions: int
    bytes_sent: int
    rejected_reasons: dict[str, int]
    """Rejected submissions counted by the class of their reason (:func:`reason_class`)."""
    parameters: int
    learners: int
    busy_s: float
    """Learner time spent training, summed over learners."""
    timelines: dict[str, list[Moment]] = field(default_factory=dict)
    """Each learner's launches, registrations, first heartbeats and exits (``learner_timelines``)."""


class RejectedTotal(NamedTuple):
    learner_id: str
    reason: str
    submissions: int
    tokens: int
    nbytes: int


def rejected_totals(session: Session, run_id: str) -> list[RejectedTotal]:
    """The run's rejected work per (learner id, reason class): a few rows kept by the rejections, whatever the history."""
    rows = session.connection().execute(
        select(RejectionTotal.learner_id, RejectionTotal.reason, RejectionTotal.submissions, RejectionTotal.tokens,
               RejectionTotal.nbytes).where(RejectionTotal.run_id == run_id)
    )
    return [RejectedTotal(lid, reason, int(n), int(t), int(b)) for lid, reason, n, t, b in rows]


def run_aggregates(session: Session, run_id: str) -> RunAggregates:
    """Everything ``summarize`` needs, from running totals and index seeks (the same cost at any history length)."""
    run = require_run(session, run_id)
    rows = learners(session, run_id)
    known = {r.id for r in rows}
    reasons: dict[str, int] = {}
    unowned = (0, 0)
    for t in rejected_totals(session, run_id):
        reasons[t.reason] = reasons.get(t.reason, 0) + t.submissions
        if t.learner_id not in known:  # learners count their own submissions; nobody counted these
            unowned = (unowned[0] + t.submissions, unowned[1] + t.nbytes)
    evals = select(Evaluation.val_loss, Evaluation.val_accuracy).where(Evaluation.run_id == run_id).limit(1)
    first = session.execute(evals.order_by(Evaluation.at, Evaluation.id)).first()
    last = session.execute(evals.order_by(Evaluation.at.desc(), Evaluation.id.desc())).first()
    heads = list(session.scalars(select(FragmentHead).where(FragmentHead.run_id == run_id)))
    merged_heads = [h for h in heads if h.version > 0]
    parameters = select(func.coalesce(func.sum(FragmentSpec.numel), 0)).where(FragmentSpec.run_id == run_id)
    return RunAggregates(
        run=run_id,
        status=run.status,
        created_at=run.created_at,
        finished_at=run.finished_at,
        config=recorded_config(run),
        tokens=account_tokens(rows, decided_tokens(session, run_id)),
        versions={h.fragment: h.version for h in heads},
        longest_merge_gap_s=max((h.longest_gap_s for h in merged_heads), default=0.0),
        last_merged_at=max((h.created_at for h in merged_heads), default=None),
        val_loss_start=first.val_loss if first else None,
        val_loss_end=last.val_loss if last else None,
        val_accuracy_end=last.val_accuracy if last else None,
        submissions=sum(r.submissions for r in rows) + int(unowned[0]),
        bytes_sent=sum(r.bytes_sent for r in rows) + int(unowned[1]),
        rejected_reasons=reasons,
        parameters=int(session.scalar(parameters) or 0),
        learners=len(rows),
        busy_s=float(sum(r.busy_s for r in rows)),
        timelines=learner_timelines(session, run_id, rows),
    )


# --- where each learner's seconds went ------------------------------------------------------------


LAUNCHED, JOINED, READY, SILENT, EXITED = "launched", "joined", "ready", "silent", "exited"
"""A learner timeline's moments: its process was launched; an incarnation registered; it was ready to step (its first
heartbeat); it was last heard of (its last heartbeat, when no exit was seen); its process ended."""


_TIMELINE_KINDS = {LEARNER_LAUNCHED: LAUNCHED, LEARNER_JOINED: JOINED, LEARNER_RESTARTED: JOINED, LEARNER_EXITED: EXITED}


# At one instant the old incarnation ends before the next one is launched, registers and steps.
_MOMENT_ORDER = {SILENT: 0, EXITED: 1, LAUNCHED: 2, JOINED: 3, READY: 4}


class Moment(NamedTuple):
    at: datetime
    kind: str


def learner_timelines(session: Session, run_id: str, rows: Sequence[Learner]) -> dict[str, list[Moment]]:
    """Each learner's moments in time order: the run's launch, registration and exit events, then per incarnation its
    first heartbeat and (before a later one) its last: index seeks, never a pass over the heartbeat history."""
    out: dict[str, list[Moment]] = {r.id: [] for r in rows}
    # Sorted here: an ORDER BY at would let the (run, at) index compete with (run, kind, at), walking every event.
    found = session.connection().execute(
        select(Event.at, Event.id, Event.actor, Event.kind).where(Event.run_id == run_id, Event.kind.in_(list(_TIMELINE_KINDS)))
    ).all()
    for at, _id, actor, kind in sorted(found, key=lambda e: (e[0], e[1])):
        if actor in out:
            out[actor].append(Moment(at, _TIMELINE_KINDS[kind]))
    hb = Heartbeat
    for r in rows:
        moments = out[r.id]
        # Incarnation k registered at the k-th join (a ledger without those events: the current one, at its row's start).
        joins = list(enumerate(m.at for m in moments if m.kind == JOINED)) or [(r.incarnation, r.started_at)]
        if not any(m.kind == JOINED for m in moments):
            moments.append(Moment(r.started_at, JOINED))
        for k, (incarnation, joined) in enumerate(joins):
            after = joins[k + 1][1] if k + 1 < len(joins) else None
            beats = select(hb.at).where(hb.run_id == run_id, hb.learner_id == r.id, hb.at >= joined, hb.incarnation == incarnation)
            if after is not None:
                beats = beats.where(hb.at < after)
            first = session.scalar(beats.order_by(hb.at).limit(1))
            if first is not None:
                moments.append(Moment(first, READY))
            if after is not None and first is not None:
                moments.append(Moment(session.scalar(beats.order_by(hb.at.desc()).limit(1)), SILENT))
        if r.status == liveness.DEAD and r.last_heartbeat_at is not None:
            moments.append(Moment(r.last_heartbeat_at, SILENT))  # the current incarnation, as last heard of
        moments.sort(key=lambda m: (m.at, _MOMENT_ORDER[m.kind]))
    return out


# --- what the dashboard's health page reads -------------------------------------------------------


def last_version_at(session: Session, run_id: str) -> datetime | None:
    """When the newest global version of any fragment was published (version 0 counts)."""
    return session.scalar(select(func.max(FragmentHead.created_at)).where(FragmentHead.run_id == run_id))


def last_merge_at(session: Session, run_id: str) -> datetime | None:
    """When the newest merged version (version > 0) was published: every merge publishes one, so the heads know."""
    return session.scalar(select(func.max(FragmentHead.created_at)).where(FragmentHead.run_id == run_id, FragmentHead.version > 0))
