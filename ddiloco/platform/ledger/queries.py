"""Every query the learner, synchronizer and dashboard need. Each takes a Session and never opens one;
the caller owns the transaction. ``now`` is always passed in (UTC, timezone-aware)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from sqlalchemy import and_, bindparam, case, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from ddiloco.platform import liveness
from ddiloco.platform.ledger.models import (
    MERGED,
    PENDING,
    REJECTED,
    Evaluation,
    Event,
    FragmentSpec,
    FragmentVersion,
    Heartbeat,
    Learner,
    Merge,
    Run,
    Submission,
    SynchronizerLease,
)


class LedgerError(RuntimeError):
    """A ledger rule refused a write."""


class LeaseLostError(LedgerError):
    """The writer does not hold the synchronizer lease (any more): its write is refused."""


class VersionConflictError(LedgerError):
    """The version to publish is not the next one: someone else published, or a gap would appear."""


class AlreadyDecidedError(LedgerError):
    """A submission to merge or reject already has a fate."""


class UnknownRunError(LedgerError):
    pass


def _insert(session: Session, model: type) -> Any:
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        return postgresql.insert(model)
    if dialect == "sqlite":
        return sqlite.insert(model)
    raise LedgerError(f"unsupported ledger backend {dialect!r}: use sqlite or postgresql")


def _inserted(session: Session, stmt: Any) -> bool:
    """Run an insert … on conflict do nothing … returning; True when a row was written."""
    return session.execute(stmt).first() is not None


# --- runs -------------------------------------------------------------------------------------


def create_run(
    session: Session,
    run_id: str,
    *,
    config_json: str,
    code_version: str,
    git_commit: str | None,
    num_fragments: int,
    token_budget: int,
    now: datetime,
    flow_run_url: str | None = None,
) -> bool:
    """Register a run; a second call with the same id is a no-op. Returns True if it was created."""
    stmt = (
        _insert(session, Run)
        .values(
            id=run_id,
            created_at=now,
            status="running",
            config_json=config_json,
            code_version=code_version,
            git_commit=git_commit,
            num_fragments=num_fragments,
            token_budget=token_budget,
            flow_run_url=flow_run_url,
        )
        .on_conflict_do_nothing(index_elements=["id"])
    )
    created = _inserted(session, stmt.returning(Run.id))
    if created:
        record_event(session, run_id, "run_created", None, f"{num_fragments} fragments", now)
    return created


def get_run(session: Session, run_id: str) -> Run | None:
    return session.get(Run, run_id)


def require_run(session: Session, run_id: str) -> Run:
    run = get_run(session, run_id)
    if run is None:
        raise UnknownRunError(f"run {run_id!r} is not in the ledger")
    return run


def list_runs(session: Session) -> list[Run]:
    return list(session.scalars(select(Run).order_by(Run.created_at.desc())))


def set_run_status(session: Session, run_id: str, status: str, now: datetime) -> None:
    values: dict[str, Any] = {"status": status}
    if status in ("finished", "failed", "stopped"):
        values["finished_at"] = now
    session.execute(update(Run).where(Run.id == run_id).values(**values))
    record_event(session, run_id, f"run_{status}", None, "", now)


def set_fragment_specs(session: Session, run_id: str, specs: Sequence[tuple[int, list[Any], int, int]]) -> None:
    """Record (fragment, tensors, numel, nbytes) once; later calls leave the first record."""
    for fragment, tensors, numel, nbytes in specs:
        stmt = (
            _insert(session, FragmentSpec)
            .values(run_id=run_id, fragment=fragment, tensors_json=json.dumps(tensors), numel=numel, nbytes=nbytes)
            .on_conflict_do_nothing(index_elements=["run_id", "fragment"])
        )
        session.execute(stmt)


def fragment_specs(session: Session, run_id: str) -> dict[int, list[Any]]:
    rows = session.scalars(select(FragmentSpec).where(FragmentSpec.run_id == run_id).order_by(FragmentSpec.fragment))
    return {r.fragment: json.loads(r.tensors_json) for r in rows}


# --- learners and heartbeats --------------------------------------------------------------------


def register_learner(
    session: Session,
    run_id: str,
    learner_id: str,
    region: str,
    now: datetime,
    *,
    host: str | None = None,
    pid: int | None = None,
    flow_run_url: str | None = None,
) -> int:
    """Start a new incarnation of a learner and return its number (0 for the first start).

    The previous incarnation's unsubmitted tokens are recorded as lost."""
    learner = session.get(Learner, (run_id, learner_id), with_for_update=True)
    if learner is not None:
        learner.host, learner.pid = host, pid
        if flow_run_url:
            learner.flow_run_url = flow_run_url
    if learner is None:
        session.add(
            Learner(
                run_id=run_id,
                id=learner_id,
                region=region,
                status="alive",
                incarnation=0,
                started_at=now,
                last_heartbeat_at=now,
                step=0,
                tokens_per_s=0.0,
                step_time_s=0.0,
                tokens_trained=0,
                tokens_submitted=0,
                tokens_lost=0,
                inc_tokens_trained=0,
                inc_tokens_submitted=0,
                busy_s=0.0,
                host=host,
                pid=pid,
                flow_run_url=flow_run_url,
            )
        )
        session.flush()
        record_event(session, run_id, "learner_joined", learner_id, f"region {region}", now)
        return 0
    lost = max(0, learner.inc_tokens_trained - learner.inc_tokens_submitted)
    learner.tokens_trained += learner.inc_tokens_trained
    learner.tokens_submitted += learner.inc_tokens_submitted
    learner.tokens_lost += lost
    learner.inc_tokens_trained = 0
    learner.inc_tokens_submitted = 0
    learner.incarnation += 1
    learner.region = region
    learner.status = "recovering"
    learner.started_at = now
    learner.last_heartbeat_at = now
    session.flush()
    record_event(
        session, run_id, "learner_restarted", learner_id, f"incarnation {learner.incarnation}; {lost} unsubmitted tokens lost", now
    )
    return learner.incarnation


def record_heartbeat(
    session: Session,
    run_id: str,
    learner_id: str,
    incarnation: int,
    *,
    now: datetime,
    step: int,
    tokens: int,
    loss: float | None,
    tokens_per_s: float,
    step_time_s: float,
    busy_s: float = 0.0,
) -> bool:
    """Record a heartbeat; ``tokens`` is the incarnation's running total. False if the incarnation was superseded."""
    session.add(
        Heartbeat(
            run_id=run_id,
            learner_id=learner_id,
            incarnation=incarnation,
            at=now,
            step=step,
            tokens=tokens,
            loss=loss,
            tokens_per_s=tokens_per_s,
            step_time_s=step_time_s,
        )
    )
    result = session.execute(
        update(Learner)
        .where(Learner.run_id == run_id, Learner.id == learner_id, Learner.incarnation == incarnation)
        .values(
            last_heartbeat_at=now,
            step=step,
            tokens_per_s=tokens_per_s,
            step_time_s=step_time_s,
            inc_tokens_trained=func.max(Learner.inc_tokens_trained, tokens)
            if session.get_bind().dialect.name == "sqlite"
            else func.greatest(Learner.inc_tokens_trained, tokens),
            busy_s=Learner.busy_s + busy_s,
            status=case((Learner.status == "dead", "recovering"), else_=Learner.status),
        )
    )
    return result.rowcount == 1


def learners(session: Session, run_id: str) -> list[Learner]:
    return list(session.scalars(select(Learner).where(Learner.run_id == run_id).order_by(Learner.region, Learner.id)))


def learner_snapshots(rows: list[Learner]) -> list[liveness.LearnerSnapshot]:
    """What the liveness rule needs of each learner row."""
    return [
        liveness.LearnerSnapshot(
            id=r.id, last_heartbeat_at=r.last_heartbeat_at, started_at=r.started_at,
            step=r.step, step_time_s=r.step_time_s, ledger_status=r.status,
        )
        for r in rows
    ]


def update_learner_statuses(
    session: Session, run_id: str, now: datetime, policy: liveness.LivenessPolicy
) -> dict[str, liveness.Verdict]:
    """Write every learner's verdict (``platform.liveness``) to its row; returns the verdicts.

    A learner newly declared dead gets a ``learner_dead`` event with the tokens it may have lost."""
    rows = learners(session, run_id)
    verdicts = liveness.learner_verdicts(learner_snapshots(rows), now, policy)
    for r in rows:
        status = verdicts[r.id].status
        if status != r.status:
            if status == liveness.DEAD:
                lost = max(0, r.inc_tokens_trained - r.inc_tokens_submitted)
                record_event(session, run_id, "learner_dead", r.id, f"{verdicts[r.id].reason}; up to {lost} tokens lost", now)
            r.status = status
    session.flush()
    return verdicts


def set_optimizer_state(session: Session, run_id: str, learner_id: str, key: str, sha256: str) -> str | None:
    """Point a learner at its newest saved optimizer state; returns the key it replaces."""
    learner = session.get(Learner, (run_id, learner_id))
    if learner is None:
        return None
    old = learner.optimizer_state_key
    learner.optimizer_state_key = key
    learner.optimizer_state_sha256 = sha256
    return old


# --- submissions --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SubmissionIn:
    uid: str
    fragment: int
    base_version: int
    c_steps: int
    c_tokens: int
    tokens_new: int
    tokens_total: int
    """The incarnation's running token count when this was sent (keeps accounting consistent)."""
    blob_key: str
    sha256: str
    nbytes: int
    codec: str
    data_batches: int | None = None
    """Micro-batches each rank had drawn when this was sent (the learner's data position)."""


def register_submission(
    session: Session, run_id: str, learner_id: str, incarnation: int, sub: SubmissionIn, now: datetime
) -> tuple[int, bool]:
    """Register a submission after its blob is written. Returns (id, created); a repeat uid is a no-op."""
    return register_submissions(session, run_id, learner_id, incarnation, [sub], now)[0]


def _submission_insert(session: Session) -> Any:
    # Built once per dialect with bound parameters, so SQLAlchemy's compiled cache is hit.
    dialect = session.get_bind().dialect.name
    if dialect not in _SUBMISSION_INSERTS:
        _SUBMISSION_INSERTS[dialect] = (
            _insert(session, Submission.__table__)
            .on_conflict_do_nothing(index_elements=["run_id", "learner_id", "uid"])
            .returning(Submission.__table__.c.id, Submission.__table__.c.uid)
        )
    return _SUBMISSION_INSERTS[dialect]


_SUBMISSION_INSERTS: dict[str, Any] = {}


def register_submissions(
    session: Session, run_id: str, learner_id: str, incarnation: int, subs: Sequence[SubmissionIn], now: datetime
) -> list[tuple[int, bool]]:
    """Register several submissions of one learner in one round trip; repeats are no-ops.

    Returns (id, created) per submission, in order."""
    rows = [
        {
            "run_id": run_id,
            "learner_id": learner_id,
            "uid": sub.uid,
            "fragment": sub.fragment,
            "base_version": sub.base_version,
            "c_steps": sub.c_steps,
            "c_tokens": sub.c_tokens,
            "tokens_new": sub.tokens_new,
            "blob_key": sub.blob_key,
            "sha256": sub.sha256,
            "nbytes": sub.nbytes,
            "codec": sub.codec,
            "created_at": now,
            "status": PENDING,
            "blob_deleted": False,
        }
        for sub in subs
    ]
    conn = session.connection()
    created = {uid: sub_id for sub_id, uid in conn.execute(_submission_insert(session), rows).all()}
    new = [sub for sub in subs if sub.uid in created]
    ids = dict(created)
    missing = [sub.uid for sub in subs if sub.uid not in created]
    if missing:
        ids.update(
            session.execute(
                select(Submission.uid, Submission.id).where(
                    Submission.run_id == run_id, Submission.learner_id == learner_id, Submission.uid.in_(missing)
                )
            ).all()
        )
    out = [(ids[sub.uid], sub.uid in created) for sub in subs]
    if not new:
        return out
    tokens_new = sum(sub.tokens_new for sub in new)
    tokens_total = max(sub.tokens_total for sub in new)
    positions = [sub.data_batches for sub in new if sub.data_batches is not None]
    greatest = func.max if session.get_bind().dialect.name == "sqlite" else func.greatest
    values = {
        "inc_tokens_submitted": Learner.inc_tokens_submitted + tokens_new,
        "inc_tokens_trained": greatest(Learner.inc_tokens_trained, tokens_total),
    }
    if positions:
        values["data_batches"] = max(positions)
    updated = conn.execute(
        update(Learner.__table__)
        .where(Learner.run_id == run_id, Learner.id == learner_id, Learner.incarnation == incarnation)
        .values(**values)
    ).rowcount
    if updated == 1:
        return out
    learner = session.get(Learner, (run_id, learner_id), with_for_update=True, populate_existing=True)
    for sub in new:
        sub_id = created[sub.uid]
        if learner is None:
            reason = f"unknown learner {learner_id!r}"
        else:
            # A paused incarnation woke up after its replacement started: its tokens were already
            # counted as lost when the replacement registered, so move them from lost to rejected.
            moved = min(learner.tokens_lost, sub.tokens_new)
            learner.tokens_lost -= moved
            learner.tokens_trained += sub.tokens_new - moved
            reason = f"superseded incarnation {incarnation} (current {learner.incarnation})"
        _decide_rejected(session, [sub_id], reason, now)
        record_event(session, run_id, "submission_rejected", learner_id, f"submission {sub_id}: {reason}", now)
    return out


def pending_counts(session: Session, run_id: str) -> dict[int, int]:
    """Pending submissions per fragment: the synchronizer's poll."""
    rows = session.execute(
        select(Submission.fragment, func.count())
        .where(Submission.run_id == run_id, Submission.status == PENDING)
        .group_by(Submission.fragment)
    )
    return {f: n for f, n in rows}


def pending_submissions(session: Session, run_id: str, fragment: int | None = None) -> list[Submission]:
    stmt = select(Submission).where(Submission.run_id == run_id, Submission.status == PENDING)
    if fragment is not None:
        stmt = stmt.where(Submission.fragment == fragment)
    return list(session.scalars(stmt.order_by(Submission.created_at, Submission.id)))


def _decide_rejected(session: Session, ids: Iterable[int], reason: str, now: datetime) -> None:
    ids = list(ids)
    if not ids:
        return
    result = session.execute(
        update(Submission)
        .where(Submission.id.in_(ids), Submission.status == PENDING)
        .values(status=REJECTED, reject_reason=reason, decided_at=now)
    )
    if result.rowcount != len(ids):
        raise AlreadyDecidedError(f"{len(ids) - result.rowcount} of submissions {ids} already have a fate")


def recent_merged_norms(session: Session, run_id: str, fragment: int, limit: int = 32, per_step: bool = False) -> list[float]:
    """Norms of the fragment's latest merged submissions (``per_step``: each divided by its c_steps)."""
    rows = session.scalars(
        select(Submission.norm / Submission.c_steps if per_step else Submission.norm)
        .where(Submission.run_id == run_id, Submission.fragment == fragment, Submission.status == MERGED, Submission.norm.is_not(None))
        .order_by(Submission.id.desc())
        .limit(limit)
    )
    return [float(n) for n in rows]


# --- the synchronizer lease -----------------------------------------------------------------------


def acquire_lease(session: Session, run_id: str, holder: str, ttl_s: float, now: datetime) -> int | None:
    """Take or renew the run's lease. Returns the fencing token, or None while another holder's lease is live."""
    lease = session.get(SynchronizerLease, run_id, with_for_update=True)
    expires = now + timedelta(seconds=ttl_s)
    if lease is None:
        stmt = (
            _insert(session, SynchronizerLease)
            .values(run_id=run_id, holder=holder, token=1, acquired_at=now, expires_at=expires)
            .on_conflict_do_nothing(index_elements=["run_id"])
        )
        if not _inserted(session, stmt.returning(SynchronizerLease.run_id)):
            return None
        record_event(session, run_id, "lease_acquired", holder, "token 1", now)
        return 1
    if lease.holder == holder and lease.expires_at > now:
        lease.expires_at = expires
        return lease.token
    if lease.expires_at > now:
        return None
    previous = lease.holder
    lease.holder = holder
    lease.token += 1
    lease.acquired_at = now
    lease.expires_at = expires
    session.flush()
    record_event(session, run_id, "lease_acquired", holder, f"token {lease.token}; took over from {previous}", now)
    return lease.token


def renew_lease(session: Session, run_id: str, holder: str, token: int, ttl_s: float, now: datetime) -> bool:
    result = session.execute(
        update(SynchronizerLease)
        .where(
            SynchronizerLease.run_id == run_id,
            SynchronizerLease.holder == holder,
            SynchronizerLease.token == token,
            SynchronizerLease.expires_at > now,
        )
        .values(expires_at=now + timedelta(seconds=ttl_s))
    )
    return result.rowcount == 1


def release_lease(session: Session, run_id: str, holder: str, token: int, now: datetime) -> None:
    session.execute(
        update(SynchronizerLease)
        .where(SynchronizerLease.run_id == run_id, SynchronizerLease.holder == holder, SynchronizerLease.token == token)
        .values(expires_at=now)
    )


def current_lease(session: Session, run_id: str) -> SynchronizerLease | None:
    return session.get(SynchronizerLease, run_id)


def _check_fence(session: Session, run_id: str, holder: str, token: int, now: datetime) -> None:
    lease = session.get(SynchronizerLease, run_id, with_for_update=True, populate_existing=True)
    if lease is None or lease.holder != holder or lease.token != token or lease.expires_at <= now:
        raise LeaseLostError(f"{holder} (token {token}) does not hold the lease of run {run_id!r}")


# --- versions and merges -------------------------------------------------------------------------


@dataclass(frozen=True)
class BlobRef:
    key: str
    sha256: str
    nbytes: int


@dataclass(frozen=True)
class MergedIn:
    submission_id: int
    weight: float
    norm: float
    staleness: int


@dataclass(frozen=True)
class MergeRecord:
    quorum: int
    live_learners: int
    grace_window_s: float
    grace_waited_s: float
    merge_s: float
    reason: str
    detail: dict[str, Any]


def latest_versions(session: Session, run_id: str) -> dict[int, FragmentVersion]:
    """The newest published version of every fragment."""
    newest = (
        select(FragmentVersion.fragment, func.max(FragmentVersion.version).label("v"))
        .where(FragmentVersion.run_id == run_id)
        .group_by(FragmentVersion.fragment)
        .subquery()
    )
    rows = session.scalars(
        select(FragmentVersion).join(
            newest,
            and_(
                FragmentVersion.run_id == run_id,
                FragmentVersion.fragment == newest.c.fragment,
                FragmentVersion.version == newest.c.v,
            ),
        )
    )
    return {r.fragment: r for r in rows}


def latest_version_numbers(session: Session, run_id: str) -> dict[int, int]:
    rows = session.execute(
        select(FragmentVersion.fragment, func.max(FragmentVersion.version))
        .where(FragmentVersion.run_id == run_id)
        .group_by(FragmentVersion.fragment)
    )
    return {f: v for f, v in rows}


def get_version(session: Session, run_id: str, fragment: int, version: int) -> FragmentVersion | None:
    return session.get(FragmentVersion, (run_id, fragment, version))


def publish_version(
    session: Session,
    run_id: str,
    fragment: int,
    version: int,
    *,
    blob: BlobRef,
    state: BlobRef,
    holder: str,
    token: int,
    now: datetime,
    merged: Sequence[MergedIn] = (),
    rejected: Sequence[tuple[int, str]] = (),
    record: MergeRecord | None = None,
) -> int | None:
    """Publish ``version`` of a fragment and decide the fate of the submissions it used, atomically.

    Refused unless the caller holds the lease with ``token``, ``version`` is exactly the next one,
    and every submission named is still pending. Returns the merge id (None for version 0)."""
    _check_fence(session, run_id, holder, token, now)
    current = session.scalar(
        select(func.max(FragmentVersion.version)).where(FragmentVersion.run_id == run_id, FragmentVersion.fragment == fragment)
    )
    expected = 0 if current is None else current + 1
    if version != expected:
        raise VersionConflictError(f"fragment {fragment}: cannot publish v{version}, the next version is v{expected}")
    session.add(
        FragmentVersion(
            run_id=run_id,
            fragment=fragment,
            version=version,
            created_at=now,
            blob_key=blob.key,
            sha256=blob.sha256,
            nbytes=blob.nbytes,
            state_key=state.key,
            state_sha256=state.sha256,
            lease_token=token,
            synchronizer=holder,
            blob_deleted=False,
        )
    )
    merge_id = None
    if record is not None:
        merge = Merge(
            run_id=run_id,
            fragment=fragment,
            version=version,
            at=now,
            quorum=record.quorum,
            live_learners=record.live_learners,
            included=len(merged),
            rejected=len(rejected),
            grace_window_s=record.grace_window_s,
            grace_waited_s=record.grace_waited_s,
            merge_s=record.merge_s,
            reason=record.reason,
            detail_json=json.dumps(record.detail),
        )
        session.add(merge)
        session.flush()
        merge_id = merge.id
    if merged:
        table = Submission.__table__
        stmt = (
            update(table)
            .where(table.c.id == bindparam("sid"), table.c.run_id == run_id, table.c.status == PENDING)
            .values(
                status=MERGED,
                merged_version=version,
                merge_id=merge_id,
                decided_at=now,
                weight=bindparam("w"),
                norm=bindparam("n"),
                staleness=bindparam("st"),
            )
        )
        params = [{"sid": m.submission_id, "w": m.weight, "n": m.norm, "st": m.staleness} for m in merged]
        changed = session.connection().execute(stmt, params).rowcount
        if changed != len(merged):
            raise AlreadyDecidedError(
                f"{len(merged) - changed} of the submissions to merge are not pending: refusing to merge them twice"
            )
    for sub_id, reason in rejected:
        _decide_rejected(session, [sub_id], reason, now)
    session.flush()
    return merge_id


def reject_submissions(
    session: Session, run_id: str, rejected: Sequence[tuple[int, str]], *, holder: str, token: int, now: datetime
) -> None:
    """Reject submissions outside a merge (e.g. every pending one failed validation)."""
    _check_fence(session, run_id, holder, token, now)
    for sub_id, reason in rejected:
        _decide_rejected(session, [sub_id], reason, now)
        record_event(session, run_id, "submission_rejected", holder, f"submission {sub_id}: {reason}", now)


def versions_for_gc(session: Session, run_id: str, keep_last: int, checkpoint_every: int) -> list[FragmentVersion]:
    """Published versions whose blobs the retention policy lets go."""
    newest = latest_version_numbers(session, run_id)
    out = []
    rows = session.scalars(
        select(FragmentVersion).where(FragmentVersion.run_id == run_id, FragmentVersion.blob_deleted.is_(False))
    )
    pending_bases = set(
        session.execute(
            select(Submission.fragment, Submission.base_version).where(Submission.run_id == run_id, Submission.status == PENDING)
        ).all()
    )
    for v in rows:
        top = newest.get(v.fragment, 0)
        keep = v.version > top - keep_last or v.version % checkpoint_every == 0 or (v.fragment, v.version) in pending_bases
        if not keep:
            out.append(v)
    return out


def submissions_for_gc(session: Session, run_id: str, limit: int = 500) -> list[Submission]:
    return list(
        session.scalars(
            select(Submission)
            .where(Submission.run_id == run_id, Submission.status != PENDING, Submission.blob_deleted.is_(False))
            .order_by(Submission.id)
            .limit(limit)
        )
    )


def mark_blobs_deleted(session: Session, versions: Iterable[FragmentVersion], submissions: Iterable[Submission]) -> None:
    for v in versions:
        v.blob_deleted = True
    for s in submissions:
        s.blob_deleted = True


# --- events and evaluations ----------------------------------------------------------------------


def record_event(session: Session, run_id: str, kind: str, actor: str | None, detail: str, now: datetime) -> None:
    session.add(Event(run_id=run_id, at=now, kind=kind, actor=actor, detail=detail))


def events(session: Session, run_id: str, limit: int = 500) -> list[Event]:
    return list(session.scalars(select(Event).where(Event.run_id == run_id).order_by(Event.at.desc(), Event.id.desc()).limit(limit)))


def record_evaluation(
    session: Session, run_id: str, *, now: datetime, tokens: int, versions_total: int, val_loss: float, val_accuracy: float | None
) -> None:
    session.add(
        Evaluation(run_id=run_id, at=now, tokens=tokens, versions_total=versions_total, val_loss=val_loss, val_accuracy=val_accuracy)
    )


def evaluations(session: Session, run_id: str) -> list[Evaluation]:
    return list(session.scalars(select(Evaluation).where(Evaluation.run_id == run_id).order_by(Evaluation.at, Evaluation.id)))


# --- accounting ---------------------------------------------------------------------------------


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


def token_accounting(session: Session, run_id: str) -> TokenAccounting:
    """:func:`account_tokens` of the run as the ledger holds it now."""
    by_status = session.execute(
        select(Submission.status, func.coalesce(func.sum(Submission.tokens_new), 0))
        .where(Submission.run_id == run_id)
        .group_by(Submission.status)
    ).all()
    return account_tokens(learners(session, run_id), {status: int(n) for status, n in by_status})


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
    merged_at: list[datetime]
    """When each merged version (version > 0) was published."""
    val_loss_start: float | None
    val_loss_end: float | None
    val_accuracy_end: float | None
    submissions: int
    bytes_sent: int
    rejected_reasons: dict[str | None, int]
    """Rejected submissions counted by their exact reason."""
    parameters: int
    learners: int
    busy_s: float
    """Learner time spent training, summed over learners."""


class SubmissionGroup(NamedTuple):
    learner: str
    status: str
    staleness: int | None
    submissions: int
    tokens: int
    bytes: int
    last_at: datetime | None


def submission_groups(session: Session, run_id: str) -> list[SubmissionGroup]:
    """The run's submissions counted by (learner, fate, staleness), with their tokens, bytes and newest time.

    One pass over the submissions, enough for the summary's totals and the dashboard's per-learner tables."""
    rows = session.execute(
        select(
            Submission.learner_id,
            Submission.status,
            Submission.staleness,
            func.count(),
            func.coalesce(func.sum(Submission.tokens_new), 0),
            func.coalesce(func.sum(Submission.nbytes), 0),
            func.max(Submission.created_at),
        )
        .where(Submission.run_id == run_id)
        .group_by(Submission.learner_id, Submission.status, Submission.staleness)
    )
    return [SubmissionGroup(lid, st, stale, int(n), int(t), int(b), last) for lid, st, stale, n, t, b, last in rows]


def run_aggregates(session: Session, run_id: str, groups: Sequence[SubmissionGroup] | None = None) -> RunAggregates:
    """Everything ``summarize`` needs, in a handful of aggregate queries (``groups``: the submissions, when already read)."""
    run = require_run(session, run_id)
    try:
        config = json.loads(run.config_json) if run.config_json else {}
    except ValueError:
        config = {}
    groups = submission_groups(session, run_id) if groups is None else groups
    by_status: dict[str, int] = {}
    for g in groups:
        by_status[g.status] = by_status.get(g.status, 0) + g.tokens
    reasons = session.execute(
        select(Submission.reject_reason, func.count())
        .where(Submission.run_id == run_id, Submission.status == REJECTED)
        .group_by(Submission.reject_reason)
    ).all()
    rows = learners(session, run_id)
    evals = select(Evaluation.val_loss, Evaluation.val_accuracy).where(Evaluation.run_id == run_id).limit(1)
    first = session.execute(evals.order_by(Evaluation.at, Evaluation.id)).first()
    last = session.execute(evals.order_by(Evaluation.at.desc(), Evaluation.id.desc())).first()
    merged_at = select(FragmentVersion.created_at).where(FragmentVersion.run_id == run_id, FragmentVersion.version > 0)
    parameters = select(func.coalesce(func.sum(FragmentSpec.numel), 0)).where(FragmentSpec.run_id == run_id)
    return RunAggregates(
        run=run_id,
        status=run.status,
        created_at=run.created_at,
        finished_at=run.finished_at,
        config=config if isinstance(config, dict) else {},
        tokens=account_tokens(rows, by_status),
        versions=latest_version_numbers(session, run_id),
        merged_at=list(session.scalars(merged_at)),
        val_loss_start=first.val_loss if first else None,
        val_loss_end=last.val_loss if last else None,
        val_accuracy_end=last.val_accuracy if last else None,
        submissions=sum(g.submissions for g in groups),
        bytes_sent=sum(g.bytes for g in groups),
        rejected_reasons={reason: int(n) for reason, n in reasons},
        parameters=int(session.scalar(parameters) or 0),
        learners=len(rows),
        busy_s=float(sum(r.busy_s for r in rows)),
    )
