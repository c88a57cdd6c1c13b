"""What a synchronizer calls: the liveness pass, the pending work, its lease (the fence of every write), publishing a
version with the fates of the submissions it used, and garbage collection. Each function takes a Session and never
opens one."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import bindparam, case, exists, func, insert, or_, select, tuple_, update
from sqlalchemy.orm import Session

from ddiloco.platform import compact, liveness, takeover
from ddiloco.platform.ids import validate_holder
from ddiloco.platform.ledger._common import _insert, _inserted, check_count, check_seconds
from ddiloco.platform.ledger.errors import AlreadyDecidedError, LeaseLostError, LedgerError, VersionConflictError
from ddiloco.platform.ledger.models import (
    GC_SUBMISSIONS,
    GC_VERSIONS,
    MERGED,
    PENDING,
    FragmentHead,
    FragmentVersion,
    Merge,
    Submission,
    SynchronizerLease,
)
from ddiloco.platform.ledger.rejections import decide_rejected
from ddiloco.platform.ledger.runs import learner_snapshots, learners, record_event

# --- liveness and pending work --------------------------------------------------------------------


REGION_CUT_OFF = "region_cut_off"
"""The event of a region whose learners all fell silent together (``liveness.region_verdicts``); its actor is the region."""


@dataclass(frozen=True)
class Statuses:
    """One liveness pass: every learner's verdict and every region's."""

    learners: dict[str, liveness.Verdict]
    regions: dict[str, liveness.Verdict]
    region_of: dict[str, str]
    """Each learner's region."""

    def counts(self) -> dict[str, dict[str, int]]:
        """Per region, its learners by status (every status, 0 included)."""
        out = {region: dict.fromkeys(liveness.LEARNER_STATUSES, 0) for region in self.regions}
        for lid, v in self.learners.items():
            out[self.region_of[lid]][v.status] += 1
        return out


def update_learner_statuses(session: Session, run_id: str, now: datetime, policy: liveness.LivenessPolicy) -> Statuses:
    """Write every learner's verdict (``platform.liveness``) to its row; returns the learners' and the regions' verdicts.

    A learner newly declared dead gets a ``learner_dead`` event with the tokens it may have lost; a region cut off by
    this pass's deaths gets a :data:`REGION_CUT_OFF` event, once: the status its last learner leaves is written here."""
    rows = learners(session, run_id)
    snaps = learner_snapshots(rows)
    verdicts = liveness.learner_verdicts(snaps, now, policy)
    regions = liveness.region_verdicts(snaps, now, policy)
    newly_dead: set[str] = set()
    for r in rows:
        status = verdicts[r.id].status
        if status != r.status:
            if status == liveness.DEAD:
                lost = max(0, r.inc_tokens_trained - r.inc_tokens_submitted)
                record_event(session, run_id, "learner_dead", r.id, f"{verdicts[r.id].reason}; up to {lost} tokens lost", now)
                newly_dead.add(r.region)
            r.status = status
    for region in sorted(newly_dead):
        if regions[region].status == liveness.CUT_OFF:
            record_event(session, run_id, REGION_CUT_OFF, region, regions[region].reason, now)
    session.flush()
    return Statuses(verdicts, regions, {r.id: r.region for r in rows})


def pending_counts(session: Session, run_id: str) -> dict[int, int]:
    """Pending submissions per fragment: the synchronizer's poll."""
    rows = session.execute(
        select(Submission.fragment, func.count())
        .where(Submission.run_id == run_id, Submission.status == PENDING)
        .group_by(Submission.fragment)
    )
    return {f: n for f, n in rows}


@dataclass(frozen=True)
class FragmentFilter:
    """Some fragments' pending work (a synchronizer shard's): ``fragments``, and with ``outside_of`` (the run's
    fragment count) also submissions naming a fragment the run does not have."""

    fragments: tuple[int, ...]
    outside_of: int | None = None


def pending_submissions(
    session: Session, run_id: str, fragment: int | None = None, *, fragments: FragmentFilter | None = None
) -> list[Submission]:
    stmt = select(Submission).where(Submission.run_id == run_id, Submission.status == PENDING)
    if fragment is not None:
        stmt = stmt.where(Submission.fragment == check_count(fragment, "fragment"))
    if fragments is not None:
        wanted = Submission.fragment.in_(fragments.fragments)
        if fragments.outside_of is not None:
            wanted = or_(wanted, Submission.fragment < 0, Submission.fragment >= fragments.outside_of)
        stmt = stmt.where(wanted)
    return list(session.scalars(stmt.order_by(Submission.created_at, Submission.id)))


def recent_merged_norms(session: Session, run_id: str, fragment: int, limit: int = 32, per_step: bool = False) -> list[float]:
    """Norms of the fragment's latest merged submissions (``per_step``: each divided by its c_steps)."""
    return [n / c if per_step else n for n, c in recent_merged_norm_steps(session, run_id, fragment, limit)]


def recent_merged_norm_steps(session: Session, run_id: str, fragment: int, limit: int = 32) -> list[tuple[float, int]]:
    """(norm, c_steps) of the fragment's latest merged submissions, newest first."""
    check_count(limit, "limit")
    rows = session.execute(
        select(Submission.norm, Submission.c_steps)
        .where(
            Submission.run_id == run_id, Submission.fragment == fragment, Submission.merged_version.is_not(None),
            Submission.status == MERGED, Submission.norm.is_not(None),
        )
        # Newest first along ix_submissions_fragment_version: a backwards seek, not a sort of every merge.
        .order_by(Submission.merged_version.desc(), Submission.id.desc())
        .limit(limit)
    )
    return [(float(n), max(1, int(c))) for n, c in rows]


# --- the synchronizer lease -----------------------------------------------------------------------


def acquire_lease(session: Session, run_id: str, holder: str, ttl_s: float, now: datetime, *, shard: int = 0,
                  present: bool = False) -> int | None:
    """Take or renew the lease of one shard of the run. Returns the fencing token, or None while another holder's
    lease is live and that holder is not known to be gone (``platform.takeover``). ``present``: the caller holds the
    shard's presence lock now (``ledger.presence``); the lease records it.

    A holder whose lease lapsed while nobody took it over gets it back with the same token: no one else can
    have published meanwhile (a takeover always bumps the token), so what it holds in memory is still current."""
    validate_holder(holder)
    check_seconds(ttl_s, "lease ttl_s"), check_count(shard, "shard")
    lease = session.get(SynchronizerLease, (run_id, shard), with_for_update=True)
    expires = now + timedelta(seconds=ttl_s)
    view = None if lease is None else takeover.LeaseView(lease.holder, lease.expires_at, lease.presence)
    decision = takeover.decide_lease(view, holder, now, present)
    if not decision.take:
        return None
    if lease is None:
        stmt = (
            _insert(session, SynchronizerLease)
            .values(run_id=run_id, shard=shard, holder=holder, token=1, acquired_at=now, expires_at=expires, presence=present)
            .on_conflict_do_nothing(index_elements=["run_id", "shard"])
        )
        if not _inserted(session, stmt.returning(SynchronizerLease.run_id)):
            return None
        record_event(session, run_id, "lease_acquired", holder, f"{_shard_label(shard)}token 1", now)
        return 1
    lease.expires_at = expires
    lease.presence = present
    if not decision.takeover:
        return lease.token
    previous = lease.holder
    lease.holder = holder
    lease.token += 1
    lease.acquired_at = now
    session.flush()
    why = " (its session ended)" if decision.kind == takeover.GONE else ""
    detail = f"{_shard_label(shard)}token {lease.token}; took over from {previous}{why}"
    record_event(session, run_id, "lease_acquired", holder, detail, now)
    return lease.token


def renew_lease(session: Session, run_id: str, holder: str, token: int, ttl_s: float, now: datetime, *, shard: int = 0,
                present: bool | None = None) -> bool:
    """Extend the lease while ``holder`` still holds ``token`` — also once it has lapsed, as long as nobody took
    it over: a renewer thread starved past the TTL (a long first pass after a takeover on a loaded machine)
    must not lose a lease no one else wants, and waste its pass's merges to the fence. ``present`` (when given):
    whether the holder holds the shard's presence lock now."""
    check_seconds(ttl_s, "lease ttl_s"), check_count(shard, "shard")
    values: dict[str, Any] = {"expires_at": now + timedelta(seconds=ttl_s)}
    if present is not None:
        values["presence"] = present
    result = session.execute(
        update(SynchronizerLease)
        .where(
            SynchronizerLease.run_id == run_id,
            SynchronizerLease.shard == shard,
            SynchronizerLease.holder == holder,
            SynchronizerLease.token == token,
        )
        .values(**values)
    )
    return result.rowcount == 1


def release_lease(session: Session, run_id: str, holder: str, token: int, now: datetime, *, shard: int = 0) -> None:
    session.execute(
        update(SynchronizerLease)
        .where(SynchronizerLease.run_id == run_id, SynchronizerLease.shard == shard, SynchronizerLease.holder == holder,
               SynchronizerLease.token == token)
        .values(expires_at=now, presence=False)
    )


def current_lease(session: Session, run_id: str, shard: int = 0) -> SynchronizerLease | None:
    return session.get(SynchronizerLease, (run_id, shard))


def leases(session: Session, run_id: str) -> list[SynchronizerLease]:
    """Every shard's lease of the run, by shard (one row per shard that was ever held)."""
    return list(session.scalars(select(SynchronizerLease).where(SynchronizerLease.run_id == run_id).order_by(SynchronizerLease.shard)))


def _shard_label(shard: int) -> str:
    return f"shard {shard}; " if shard else ""


def _check_fence(session: Session, run_id: str, holder: str, token: int, now: datetime, shard: int) -> None:
    lease = session.get(SynchronizerLease, (run_id, shard), with_for_update=True, populate_existing=True)
    if lease is None or lease.holder != holder or lease.token != token or lease.expires_at <= now:
        raise LeaseLostError(f"{holder} (token {token}) does not hold the {_shard_label(shard)}lease of run {run_id!r}")


# --- versions and merges --------------------------------------------------------------------------


BlobRef = compact.Ref
"""A blob the ledger names: key, sha256, size."""


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


@functools.cache
def _lease_holds(lock: bool = True) -> Any:
    """EXISTS: ``x_holder`` holds the lease of run ``x_run``'s shard ``x_shard`` with ``x_token`` at ``x_now`` (bound
    parameters: :func:`_lease_params`). With ``lock``, on PostgreSQL the lease row is share-locked, so a takeover waits
    until this transaction has committed (the fence of a publish)."""
    c = SynchronizerLease.__table__.c
    stmt = select(c.run_id).where(
        c.run_id == bindparam("x_run", type_=c.run_id.type), c.shard == bindparam("x_shard", type_=c.shard.type),
        c.holder == bindparam("x_holder", type_=c.holder.type), c.token == bindparam("x_token", type_=c.token.type),
        c.expires_at > bindparam("x_now", type_=c.expires_at.type),
    )
    return exists(stmt.with_for_update(read=True) if lock else stmt)


def _lease_params(run_id: str, holder: str, token: int, now: datetime, shard: int) -> dict[str, Any]:
    return {"x_run": run_id, "x_holder": holder, "x_token": token, "x_now": now, "x_shard": shard}


def _refuse_publish(session: Session, run_id: str, fragment: int, version: int, holder: str, token: int, now: datetime,
                    shard: int) -> None:
    """Why a publish wrote nothing: the lease, else the version (raises; returns when neither is the cause)."""
    # A plain read: the publish may already share-lock the lease row, and upgrading that lock would deadlock
    # with a concurrent publish that holds one too.
    if not session.scalar(select(_lease_holds(lock=False)), _lease_params(run_id, holder, token, now, shard)):
        raise LeaseLostError(f"{holder} (token {token}) does not hold the {_shard_label(shard)}lease of run {run_id!r}")
    current = session.scalar(
        select(FragmentHead.version).where(FragmentHead.run_id == run_id, FragmentHead.fragment == fragment)
    )
    expected = 0 if current is None else current + 1
    if version != expected:
        raise VersionConflictError(f"fragment {fragment}: cannot publish v{version}, the next version is v{expected}")


_MERGE_INSERT = insert(Merge.__table__).returning(Merge.__table__.c.id)
_VERSION_INSERT = insert(FragmentVersion.__table__)
_MERGED_UPDATE = (
    update(Submission.__table__)
    .where(Submission.__table__.c.id == bindparam("x_id"), Submission.__table__.c.run_id == bindparam("x_run"),
           Submission.__table__.c.status == PENDING)
    .values(status=MERGED, merged_version=bindparam("x_version"), merge_id=bindparam("x_merge"), decided_at=bindparam("x_now"),
            weight=bindparam("x_weight"), norm=bindparam("x_norm"), staleness=bindparam("x_staleness"))
)
"""A merge's statements, built once with bound parameters (see :func:`_head_advance`)."""


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
    shard: int = 0,
    compact_json: str | None = None,
) -> int | None:
    """Publish ``version`` of a fragment and decide the fate of the submissions it used, atomically.

    Refused unless the caller holds the lease of ``shard`` (the fragment's shard) with ``token``, ``version`` is exactly the next one,
    and every submission named is still pending. Returns the merge id (None without a record).

    A merge is four statements: the merge row, the submissions' fates, the fenced advance of the
    fragment's head (with its running totals) and the version row; a rejection adds its own."""
    conn = session.connection()
    head_values = dict(
        version=version, created_at=now, blob_key=blob.key, sha256=blob.sha256, nbytes=blob.nbytes, state_key=state.key,
        state_sha256=state.sha256, lease_token=token, synchronizer=holder, published_s=now.timestamp(), compact_json=compact_json,
    )
    if version == 0:
        _check_fence(session, run_id, holder, token, now, shard)
        stmt = _insert(session, FragmentHead.__table__).values(
            run_id=run_id, fragment=fragment, tokens_merged=0, submissions_merged=0, longest_gap_s=0.0, **head_values
        )
        if not _inserted(session, stmt.on_conflict_do_nothing(index_elements=["run_id", "fragment"]).returning(FragmentHead.version)):
            _refuse_publish(session, run_id, fragment, version, holder, token, now, shard)
    merge_id = None
    if record is not None:
        merge_id = conn.execute(_MERGE_INSERT, {
            "run_id": run_id, "fragment": fragment, "version": version, "at": now, "quorum": record.quorum,
            "live_learners": record.live_learners, "included": len(merged), "rejected": len(rejected),
            "grace_window_s": record.grace_window_s, "grace_waited_s": record.grace_waited_s, "merge_s": record.merge_s,
            "reason": record.reason, "detail_json": json.dumps(record.detail),
        }).scalar_one()
    if merged:
        params = [{"x_id": m.submission_id, "x_run": run_id, "x_version": version, "x_merge": merge_id, "x_now": now,
                   "x_weight": m.weight, "x_norm": m.norm, "x_staleness": m.staleness} for m in merged]
        changed = conn.execute(_MERGED_UPDATE, params).rowcount
        if changed != len(merged):
            _refuse_publish(session, run_id, fragment, version, holder, token, now, shard)
            raise AlreadyDecidedError(
                f"{len(merged) - changed} of the submissions to merge are not pending: refusing to merge them twice"
            )
    for sub_id, reason in rejected:
        decide_rejected(session, run_id, [sub_id], reason, now)
    if version > 0:
        _advance_head(session, run_id, fragment, version, head_values, holder, token, now, shard)
    conn.execute(_VERSION_INSERT, {
        "run_id": run_id, "fragment": fragment, "version": version, "created_at": now, "blob_key": blob.key,
        "sha256": blob.sha256, "nbytes": blob.nbytes, "state_key": state.key, "state_sha256": state.sha256,
        "lease_token": token, "synchronizer": holder, "blob_deleted": False, "gc_done": False, "compact_json": compact_json,
    })
    return merge_id


def _advance_head(
    session: Session, run_id: str, fragment: int, version: int, values: dict[str, Any], holder: str, token: int, now: datetime,
    shard: int,
) -> None:
    """Move the fragment's head from ``version - 1`` to ``version`` under the lease, adding what this version merged."""
    params = {**_lease_params(run_id, holder, token, now, shard), "x_fragment": fragment, "x_version": version,
              "x_previous": version - 1, **{f"h_{k}": v for k, v in values.items()}}
    result = session.connection().execute(_head_advance(tuple(values)), params)
    if result.rowcount != 1:
        _refuse_publish(session, run_id, fragment, version, holder, token, now, shard)
        raise LedgerError(f"fragment {fragment}: v{version} was refused")


@functools.cache
def _head_advance(columns: tuple[str, ...]) -> Any:
    """The fenced UPDATE of :func:`_advance_head` setting ``columns`` (bound as ``h_<column>``), built once with bound
    parameters: SQLAlchemy's compiled cache is then hit without working out the statement's cache key at each merge."""
    h, sub = FragmentHead.__table__.c, Submission.__table__.c
    heads = FragmentHead.__table__.alias("others")
    run, version = bindparam("x_run", type_=h.run_id.type), bindparam("x_version", type_=h.version.type)
    merged_here = (sub.run_id == run) & (sub.fragment == bindparam("x_fragment")) & (sub.merged_version == version) & (
        sub.status == MERGED
    )
    # The wait since the run's previous merged version, whichever fragment it was (summary: longest downtime).
    gap = bindparam("h_published_s", type_=h.published_s.type) - select(func.max(heads.c.published_s)).where(
        heads.c.run_id == run, heads.c.version > 0).scalar_subquery()
    return (
        update(FragmentHead.__table__)
        .where(h.run_id == run, h.fragment == bindparam("x_fragment", type_=h.fragment.type),
               h.version == bindparam("x_previous", type_=h.version.type), _lease_holds())
        .values(
            **{c: bindparam(f"h_{c}", type_=h[c].type) for c in columns},
            tokens_merged=h.tokens_merged + select(func.coalesce(func.sum(sub.tokens_new), 0)).where(merged_here).scalar_subquery(),
            submissions_merged=h.submissions_merged + select(func.count()).where(merged_here).scalar_subquery(),
            longest_gap_s=case((gap > h.longest_gap_s, gap), else_=h.longest_gap_s),
        )
    )


def reject_submissions(
    session: Session, run_id: str, rejected: Sequence[tuple[int, str]], *, holder: str, token: int, now: datetime,
    shard: int = 0,
) -> None:
    """Reject submissions outside a merge (e.g. every pending one failed validation)."""
    _check_fence(session, run_id, holder, token, now, shard)
    for sub_id, reason in rejected:
        decide_rejected(session, run_id, [sub_id], reason, now)
        record_event(session, run_id, "submission_rejected", holder, f"submission {sub_id}: {reason}", now)


# --- garbage collection ---------------------------------------------------------------------------


GC_BATCH = 2_000
"""Most versions or submissions one garbage-collection pass settles: a pass stays short whatever the backlog."""


def versions_for_gc(
    session: Session, run_id: str, keep_last: int, checkpoint_every: int, limit: int = GC_BATCH
) -> list[FragmentVersion]:
    """Published versions whose blobs the retention policy lets go.

    Reads only versions GC has not settled yet (a partial index holds just those); the ones kept for good
    (every ``checkpoint_every``-th) are marked settled here, so no later pass reads them again."""
    check_count(keep_last, "keep_last", least=1), check_count(checkpoint_every, "checkpoint_every", least=1)
    check_count(limit, "limit")
    heads = session.execute(
        select(FragmentHead.fragment, FragmentHead.version, FragmentHead.compact_json).where(FragmentHead.run_id == run_id)
    ).all()
    newest = {f: v for f, v, _ in heads}
    rows = session.scalars(
        select(FragmentVersion)
        .where(FragmentVersion.run_id == run_id, GC_VERSIONS)
        .order_by(FragmentVersion.fragment, FragmentVersion.version)
        .limit(limit)
    ).all()
    needed = set(
        session.execute(
            select(Submission.fragment, Submission.base_version).where(Submission.run_id == run_id, Submission.status == PENDING)
        ).all()
    )
    # The version that built each fragment's current base of the compact downloads: its base and step blobs are in use.
    needed |= {(f, compact.base_of(c)) for f, _, c in heads}
    out, kept = [], []
    for v in rows:
        if v.version > newest.get(v.fragment, 0) - keep_last or (v.fragment, v.version) in needed:
            continue  # still needed: looked at again next time
        if v.version % checkpoint_every == 0:
            kept.append(v)
        else:
            out.append(v)
    _settle_versions(session, run_id, kept, deleted=False)
    return out


def submissions_for_gc(session: Session, run_id: str, limit: int = 500) -> list[Submission]:
    """Decided submissions whose blobs are not deleted yet, oldest first (seeks the partial index ``ix_submissions_gc``)."""
    check_count(limit, "limit")
    return list(
        session.scalars(
            select(Submission).where(Submission.run_id == run_id, GC_SUBMISSIONS).order_by(Submission.id).limit(limit)
        )
    )


def _settle_versions(session: Session, run_id: str, versions: Sequence[FragmentVersion], *, deleted: bool) -> None:
    keys = [(v.fragment, v.version) for v in versions]
    for start in range(0, len(keys), 500):
        values: dict[str, Any] = {"gc_done": True, **({"blob_deleted": True} if deleted else {})}
        session.execute(
            update(FragmentVersion)
            .where(FragmentVersion.run_id == run_id, tuple_(FragmentVersion.fragment, FragmentVersion.version).in_(keys[start:start + 500]))
            .values(**values)
            .execution_options(synchronize_session=False)
        )


def mark_blobs_deleted(session: Session, versions: Iterable[FragmentVersion], submissions: Iterable[Submission]) -> None:
    """Record deleted blobs: one UPDATE per table (per 500 rows), whatever session the rows were read in."""
    by_run: dict[str, list[FragmentVersion]] = {}
    for v in versions:
        by_run.setdefault(v.run_id, []).append(v)
    for run_id, rows in by_run.items():
        _settle_versions(session, run_id, rows, deleted=True)
    ids = [sb.id for sb in submissions]
    for start in range(0, len(ids), 500):
        session.execute(
            update(Submission).where(Submission.id.in_(ids[start:start + 500])).values(blob_deleted=True)
            .execution_options(synchronize_session=False)
        )
