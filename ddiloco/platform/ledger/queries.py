"""Every query the learner, synchronizer and dashboard need. Each takes a Session and never opens one;
the caller owns the transaction. ``now`` is always passed in (UTC, timezone-aware)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from sqlalchemy import Integer, String, Text, bindparam, case, cast, exists, func, insert, literal, or_, select, tuple_, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from ddiloco.platform import compact, liveness
from ddiloco.platform.config import world_size_problem
from ddiloco.platform.ids import validate_holder, validate_id
from ddiloco.platform.ledger.models import (
    GC_SUBMISSIONS,
    GC_VERSIONS,
    MERGED,
    PENDING,
    REJECTED,
    Evaluation,
    Event,
    FragmentHead,
    FragmentSpec,
    FragmentVersion,
    Heartbeat,
    Learner,
    Merge,
    RejectionTotal,
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


class SubmissionConflictError(LedgerError):
    """A submission id registered again with other content: the first registration stands, the second is refused."""


class WorldSizeError(LedgerError):
    """A learner registering with more ranks than the run allows (``learners.max_world_size``)."""


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
    validate_id(run_id, "run")  # ids are shown and become store keys: no markup, no path tricks
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
    world_size: int = 1,
    max_world_size: int | None = None,
) -> int:
    """Start a new incarnation of a learner of ``world_size`` ranks and return its number (0 for the first start).

    The previous incarnation's unsubmitted tokens are recorded as lost. A world above ``max_world_size`` (the run's
    ``learners.max_world_size``; None: not checked here) is refused; the synchronizer caps what it judges by that
    limit all the same, so a row written around this function buys no more."""
    validate_id(learner_id, "learner"), validate_id(region, "region")
    why = world_size_problem(world_size, world_size if max_world_size is None else max_world_size)
    if why:
        raise WorldSizeError(f"learner {learner_id!r} of run {run_id!r}: {why}")
    learner = session.get(Learner, (run_id, learner_id), with_for_update=True)
    if learner is not None:
        learner.host, learner.pid, learner.world_size = host, pid, world_size
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
                world_size=world_size,
            )
        )
        session.flush()
        record_event(session, run_id, LEARNER_JOINED, learner_id, f"region {region}", now)
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
        session, run_id, LEARNER_RESTARTED, learner_id, f"incarnation {learner.incarnation}; {lost} unsubmitted tokens lost", now
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
            **({} if loss is None else {"loss": loss}),
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

    def __post_init__(self) -> None:
        # Counts no honest learner sends are refused before they reach the accounting; what needs the
        # run's config to judge (tokens per step, steps per period) the synchronizer rejects with a reason.
        if self.c_steps < 1 or self.c_tokens < 1 or not 0 <= self.tokens_new <= self.c_tokens or self.base_version < 0:
            raise ValueError(f"submission {self.uid!r}: implausible counts (c_steps={self.c_steps}, c_tokens={self.c_tokens}, "
                             f"tokens_new={self.tokens_new}, base_version={self.base_version})")
        if self.nbytes < 0 or self.fragment < 0:
            raise ValueError(f"submission {self.uid!r}: negative fragment or size")


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


def _greatest(session: Session) -> Any:
    return func.max if session.get_bind().dialect.name == "sqlite" else func.greatest


def _insert_submissions(
    session: Session, run_id: str, learner_id: str, subs: Sequence[SubmissionIn], now: datetime
) -> tuple[list[tuple[int, bool]], list[SubmissionIn], dict[str, int]]:
    """Insert the submissions (repeats are no-ops): (id, created) per submission, the new ones, their ids by uid."""
    if not subs:
        return [], [], {}
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
    created = {uid: sub_id for sub_id, uid in session.connection().execute(_submission_insert(session), rows).all()}
    ids = dict(created)
    missing = [sub for sub in subs if sub.uid not in created]
    if missing:
        content = ("fragment", "base_version", "c_steps", "c_tokens", "tokens_new", "blob_key", "sha256", "nbytes", "codec")
        rows = session.execute(
            select(Submission.uid, Submission.id, *(getattr(Submission, c) for c in content)).where(
                Submission.run_id == run_id, Submission.learner_id == learner_id, Submission.uid.in_([m.uid for m in missing])
            )
        ).all()
        before = {row.uid: row for row in rows}
        for sub in missing:  # a retry repeats itself exactly; anything else would vanish from the accounting
            if tuple(getattr(before[sub.uid], c) for c in content) != tuple(getattr(sub, c) for c in content):
                raise SubmissionConflictError(f"submission {sub.uid!r} of learner {learner_id!r} is already registered with other content")
        ids.update({uid: row.id for uid, row in before.items()})
    return [(ids[sub.uid], sub.uid in created) for sub in subs], [sub for sub in subs if sub.uid in created], created


def _registration_values(session: Session, new: Sequence[SubmissionIn], now: datetime) -> dict[str, Any]:
    """What registering ``new`` adds to its learner's row: the incarnation's counts and the learner's totals."""
    if not new:
        return {}
    tokens_new = sum(sub.tokens_new for sub in new)
    values: dict[str, Any] = {
        "inc_tokens_submitted": Learner.inc_tokens_submitted + tokens_new,
        "inc_tokens_trained": _greatest(session)(Learner.inc_tokens_trained, max(sub.tokens_total for sub in new)),
        "submissions": Learner.submissions + len(new),
        "tokens_sent": Learner.tokens_sent + tokens_new,
        "bytes_sent": Learner.bytes_sent + sum(sub.nbytes for sub in new),
        "last_submission_at": now,
    }
    positions = [sub.data_batches for sub in new if sub.data_batches is not None]
    if positions:
        values["data_batches"] = max(positions)
    return values


def _reject_superseded(
    session: Session, run_id: str, learner_id: str, incarnation: int, new: Sequence[SubmissionIn], created: dict[str, int],
    now: datetime,
) -> None:
    """Submissions of an incarnation that is not the learner's current one (or of no learner): rejected."""
    learner = session.get(Learner, (run_id, learner_id), with_for_update=True, populate_existing=True)
    if learner is None:
        reason = f"{UNKNOWN_LEARNER} {learner_id!r}"
    else:
        reason = f"{SUPERSEDED} {incarnation} (current {learner.incarnation})"
        for sub in new:
            # A paused incarnation woke up after its replacement started: its tokens were already
            # counted as lost when the replacement registered, so move them from lost to rejected.
            moved = min(learner.tokens_lost, sub.tokens_new)
            learner.tokens_lost -= moved
            learner.tokens_trained += sub.tokens_new - moved
            learner.submissions += 1
            learner.tokens_sent += sub.tokens_new
            learner.bytes_sent += sub.nbytes
            learner.last_submission_at = now
    ids = [created[sub.uid] for sub in new]
    if _may_decide(session):
        _decide_rejected(session, run_id, ids, reason, now)
    else:
        # A least-privilege learner role (``ddiloco ledger roles``) may not write fates or the run's totals: the
        # synchronizer role's SECURITY DEFINER function rejects exactly its own superseded submissions instead.
        ids_param = bindparam("ids", ids, type_=postgresql.ARRAY(postgresql.BIGINT))
        session.execute(select(getattr(func, REJECT_SUPERSEDED)(run_id, learner_id, incarnation, ids_param, reason, now)))
    for sub_id in ids:
        record_event(session, run_id, "submission_rejected", learner_id, f"submission {sub_id}: {reason}", now)


UNKNOWN_LEARNER, SUPERSEDED = "unknown learner", "superseded incarnation"
"""How the reasons :func:`_reject_superseded` gives begin (the learners' function counts them by these classes)."""
REJECT_SUPERSEDED = "ddiloco_reject_superseded"
"""The PostgreSQL function a learner role rejects its superseded submissions with (created by ``ledger.roles``)."""


def _may_decide(session: Session) -> bool:
    """Whether the session's database user may write submissions' fates and the run's totals itself."""
    if session.get_bind().dialect.name != "postgresql":
        return True
    return bool(session.scalar(select(func.has_column_privilege(Run.__tablename__, "tokens_rejected", "UPDATE"))))


def register_submissions(
    session: Session, run_id: str, learner_id: str, incarnation: int, subs: Sequence[SubmissionIn], now: datetime
) -> list[tuple[int, bool]]:
    """Register several submissions of one learner in one round trip; repeats are no-ops.

    Returns (id, created) per submission, in order."""
    out, new, created = _insert_submissions(session, run_id, learner_id, subs, now)
    if not new:
        return out
    updated = session.connection().execute(
        update(Learner.__table__)
        .where(Learner.run_id == run_id, Learner.id == learner_id, Learner.incarnation == incarnation)
        .values(**_registration_values(session, new, now))
    ).rowcount
    if updated != 1:
        _reject_superseded(session, run_id, learner_id, incarnation, new, created, now)
    return out


# --- the learner's one round trip per step -------------------------------------------------------


@dataclass(frozen=True)
class Beat:
    """A learner's live figures, written to its row by every exchange (``history``: also kept as a heartbeat row)."""

    step: int
    tokens: int
    """The incarnation's running token count."""
    loss: float | None
    tokens_per_s: float
    step_time_s: float
    busy_s: float = 0.0
    history: bool = True
    queue_depth: int | None = None
    """Fragments with an increment waiting in the learner's upload queue."""
    oldest_unsent_s: float | None = None
    """How long the oldest of them has waited."""
    link_json: str | None = None
    """The link's measured rates and the send period and codec in force, with the reason (JSON)."""

    def link_values(self) -> dict[str, Any]:
        """The upload link's columns, as the learner row and a heartbeat row hold them."""
        return {"queue_depth": self.queue_depth, "oldest_unsent_s": self.oldest_unsent_s, "link_json": self.link_json}


class HeadRef(NamedTuple):
    """What a learner needs of a fragment's newest version to fetch it."""

    fragment: int
    version: int
    blob_key: str
    sha256: str
    nbytes: int
    compact_json: str | None = None
    """Its compact form (``platform/compact.py``), when the run publishes one."""


@dataclass(frozen=True)
class Exchange:
    registered: list[tuple[int, bool]]
    """(id, created) per submission, in order."""
    current: bool
    """The incarnation is still the learner's current one (False: superseded, or no such learner)."""
    run_status: str | None
    heads: dict[int, HeadRef]
    """The newest version of every fragment (of those newer than the caller had seen, when it said)."""


def _heads_json(session: Session, run_id: str, known: Mapping[int, int] | None = None) -> Any:
    """The fragment heads newer than ``known`` (fragment -> version the caller has seen; None: every head) as one JSON
    array, so the learner's row update returns them in the same statement — and a learner polling several times a
    second is not sent the same heads again each time."""
    h = FragmentHead
    seen = None if known is None else json.dumps({str(int(f)): int(v) for f, v in known.items()})
    if session.get_bind().dialect.name == "sqlite":
        agg = func.json_group_array(func.json_array(h.fragment, h.version, h.blob_key, h.sha256, h.nbytes, h.compact_json))
        had = func.json_extract(bindparam("known", seen, type_=Text), literal('$."') + cast(h.fragment, String) + literal('"'))
    else:
        agg = func.json_agg(func.json_build_array(h.fragment, h.version, h.blob_key, h.sha256, h.nbytes, h.compact_json))
        had = func.jsonb_extract_path_text(cast(bindparam("known", seen, type_=Text), postgresql.JSONB), cast(h.fragment, Text))
    where = [h.run_id == run_id]
    if seen is not None:
        where.append(h.version > func.coalesce(cast(had, Integer), -1))
    return select(agg).where(*where).scalar_subquery()


def _parse_heads(raw: Any) -> dict[int, HeadRef]:
    items = json.loads(raw) if isinstance(raw, str | bytes) else (raw or [])
    return {int(f): HeadRef(int(f), int(v), str(k), str(sha), int(n), None if c is None else str(c)) for f, v, k, sha, n, c in items}


def learner_exchange(
    session: Session,
    run_id: str,
    learner_id: str,
    incarnation: int,
    subs: Sequence[SubmissionIn],
    beat: Beat | None,
    now: datetime,
    events: Sequence[tuple[str, str]] = (),
    known: Mapping[int, int] | None = None,
) -> Exchange:
    """A learner step's whole conversation with the ledger: register ``subs``, record ``beat`` and read the run's
    status and every fragment's head newer than ``known`` (fragment -> version seen; None: all) — two statements
    (three when the beat is kept as a heartbeat row; one more when the learner has ``events`` to record, (kind,
    detail) each, as when it changes its send cadence)."""
    out, new, created = _insert_submissions(session, run_id, learner_id, subs, now)
    values = _registration_values(session, new, now)
    if beat is not None:
        trained = max([beat.tokens, *(sub.tokens_total for sub in new)])
        values.update(
            last_heartbeat_at=now,
            step=beat.step,
            tokens_per_s=beat.tokens_per_s,
            step_time_s=beat.step_time_s,
            inc_tokens_trained=_greatest(session)(Learner.inc_tokens_trained, trained),
            busy_s=Learner.busy_s + beat.busy_s,
            status=case((Learner.status == "dead", "recovering"), else_=Learner.status),
            **beat.link_values(),
        )
        if beat.loss is not None:
            values["loss"] = beat.loss
    status = select(Run.status).where(Run.id == run_id).scalar_subquery()
    stmt = update(Learner.__table__).where(
        Learner.run_id == run_id, Learner.id == learner_id, Learner.incarnation == incarnation
    )
    # An update must set something: a bare poll rewrites the incarnation with itself.
    row = session.connection().execute(
        stmt.values(**(values or {"incarnation": Learner.incarnation})).returning(status, _heads_json(session, run_id, known))
    ).first()
    if row is None:
        if new:
            _reject_superseded(session, run_id, learner_id, incarnation, new, created, now)
        run_status = session.scalar(select(Run.status).where(Run.id == run_id))
        return Exchange(out, False, run_status, read_heads(session, run_id))
    if beat is not None and beat.history:
        session.connection().execute(
            insert(Heartbeat.__table__).values(
                run_id=run_id, learner_id=learner_id, incarnation=incarnation, at=now, step=beat.step, tokens=beat.tokens,
                loss=beat.loss, tokens_per_s=beat.tokens_per_s, step_time_s=beat.step_time_s, **beat.link_values(),
            )
        )
    if events:
        session.connection().execute(
            insert(Event.__table__), [{"run_id": run_id, "at": now, "kind": k, "actor": learner_id, "detail": d} for k, d in events]
        )
    return Exchange(out, True, row[0], _parse_heads(row[1]))


def read_heads(session: Session, run_id: str) -> dict[int, HeadRef]:
    """Every fragment's newest version, for a reader that is not (yet) a registered learner."""
    rows = session.execute(
        select(FragmentHead.fragment, FragmentHead.version, FragmentHead.blob_key, FragmentHead.sha256, FragmentHead.nbytes,
               FragmentHead.compact_json)
        .where(FragmentHead.run_id == run_id)
    )
    return {r.fragment: HeadRef(*r) for r in rows}


def poll_run(session: Session, run_id: str) -> tuple[str | None, dict[int, HeadRef]]:
    """(the run's status, every fragment's newest version) in one statement; (None, {}) for a run not in the ledger."""
    rows = session.execute(
        select(Run.status, FragmentHead.fragment, FragmentHead.version, FragmentHead.blob_key, FragmentHead.sha256,
               FragmentHead.nbytes, FragmentHead.compact_json)
        .select_from(Run)
        .outerjoin(FragmentHead, FragmentHead.run_id == Run.id)
        .where(Run.id == run_id)
    ).all()
    if not rows:
        return None, {}
    return rows[0][0], {r[1]: HeadRef(*r[1:]) for r in rows if r[1] is not None}


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
        stmt = stmt.where(Submission.fragment == fragment)
    if fragments is not None:
        wanted = Submission.fragment.in_(fragments.fragments)
        if fragments.outside_of is not None:
            wanted = or_(wanted, Submission.fragment < 0, Submission.fragment >= fragments.outside_of)
        stmt = stmt.where(wanted)
    return list(session.scalars(stmt.order_by(Submission.created_at, Submission.id)))


def _decide_rejected(session: Session, run_id: str, ids: Iterable[int], reason: str, now: datetime) -> None:
    """Reject pending submissions of the run, adding them to the run's running totals of rejected work and to
    each learner id's total for the reason's class."""
    ids = list(ids)
    if not ids:
        return
    decided = session.execute(rejection(run_id, Submission.id.in_(ids), reason, now)).all()
    if len(decided) != len(ids):
        raise AlreadyDecidedError(f"{len(ids) - len(decided)} of submissions {ids} already have a fate")
    tokens = sum(int(t) for _, t, _ in decided)
    session.execute(count_rejected(run_id, tokens, len(decided)).execution_options(synchronize_session=False))
    by_learner: dict[str, tuple[int, int, int]] = {}
    for learner_id, t, b in decided:
        n0, t0, b0 = by_learner.get(learner_id, (0, 0, 0))
        by_learner[learner_id] = (n0 + 1, t0 + int(t), b0 + int(b))
    rows = [{"run_id": run_id, "learner_id": lid, "reason": reason_class(reason), "submissions": n, "tokens": t,
             "nbytes": b} for lid, (n, t, b) in by_learner.items()]
    session.execute(count_rejected_by(_insert(session, RejectionTotal), rows))


def rejection(run_id: Any, which: Any, reason: Any, now: Any) -> Any:
    """UPDATE … RETURNING (learner_id, tokens_new, nbytes): the run's pending submissions that ``which`` picks become
    rejected.

    The arguments are values or SQL expressions: ``ledger.roles`` compiles this same statement into the
    learners' SECURITY DEFINER function."""
    return (
        update(Submission)
        .where(which, Submission.run_id == run_id, Submission.status == PENDING)
        .values(status=REJECTED, reject_reason=reason, decided_at=now)
        .returning(Submission.learner_id, Submission.tokens_new, Submission.nbytes)
    )


def count_rejected(run_id: Any, tokens: Any, submissions: Any) -> Any:
    """UPDATE: add rejected work to the run's running totals (values or SQL expressions, as :func:`rejection`)."""
    return (
        update(Run)
        .where(Run.id == run_id)
        .values(tokens_rejected=Run.tokens_rejected + tokens, submissions_rejected=Run.submissions_rejected + submissions)
    )


def count_rejected_by(insert_: Any, rows: Sequence[Mapping[str, Any]]) -> Any:
    """INSERT … ON CONFLICT: add rejected work to (run, learner id, reason class) totals; ``insert_`` is the dialect's
    ``insert(RejectionTotal)`` and the rows' values may be SQL expressions (as :func:`rejection`)."""
    stmt = insert_.values(list(rows))
    return stmt.on_conflict_do_update(
        index_elements=["run_id", "learner_id", "reason"],
        set_={c: getattr(RejectionTotal, c) + getattr(stmt.excluded, c) for c in ("submissions", "tokens", "nbytes")},
    )


UNKNOWN_REASON = "unknown"


def reason_class(reason: str | None) -> str:
    """A rejection reason without its figures and names ('stale: based on v3, now v5' -> 'stale', "unknown learner
    'x'" -> 'unknown learner'): the few words rejected work is counted by in the ledger, the summary and the metrics."""
    if not reason:
        return UNKNOWN_REASON
    words = re.split(r"[\d:(=<>'\"]", reason, maxsplit=1)[0].lower()
    return " ".join(re.sub(r"[^a-z]+", " ", words).split())[:48] or "other"


def recent_merged_norms(session: Session, run_id: str, fragment: int, limit: int = 32, per_step: bool = False) -> list[float]:
    """Norms of the fragment's latest merged submissions (``per_step``: each divided by its c_steps)."""
    return [n / c if per_step else n for n, c in recent_merged_norm_steps(session, run_id, fragment, limit)]


def recent_merged_norm_steps(session: Session, run_id: str, fragment: int, limit: int = 32) -> list[tuple[float, int]]:
    """(norm, c_steps) of the fragment's latest merged submissions, newest first."""
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


def acquire_lease(session: Session, run_id: str, holder: str, ttl_s: float, now: datetime, *, shard: int = 0) -> int | None:
    """Take or renew the lease of one shard of the run. Returns the fencing token, or None while another holder's
    lease is live.

    A holder whose lease lapsed while nobody took it over gets it back with the same token: no one else can
    have published meanwhile (a takeover always bumps the token), so what it holds in memory is still current."""
    validate_holder(holder)
    lease = session.get(SynchronizerLease, (run_id, shard), with_for_update=True)
    expires = now + timedelta(seconds=ttl_s)
    if lease is None:
        stmt = (
            _insert(session, SynchronizerLease)
            .values(run_id=run_id, shard=shard, holder=holder, token=1, acquired_at=now, expires_at=expires)
            .on_conflict_do_nothing(index_elements=["run_id", "shard"])
        )
        if not _inserted(session, stmt.returning(SynchronizerLease.run_id)):
            return None
        record_event(session, run_id, "lease_acquired", holder, f"{_shard_label(shard)}token 1", now)
        return 1
    if lease.holder == holder:
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
    record_event(session, run_id, "lease_acquired", holder, f"{_shard_label(shard)}token {lease.token}; took over from {previous}", now)
    return lease.token


def renew_lease(session: Session, run_id: str, holder: str, token: int, ttl_s: float, now: datetime, *, shard: int = 0) -> bool:
    """Extend the lease while ``holder`` still holds ``token`` — also once it has lapsed, as long as nobody took
    it over: a renewer thread starved past the TTL (a long first pass after a takeover on a loaded machine)
    must not lose a lease no one else wants, and waste its pass's merges to the fence."""
    result = session.execute(
        update(SynchronizerLease)
        .where(
            SynchronizerLease.run_id == run_id,
            SynchronizerLease.shard == shard,
            SynchronizerLease.holder == holder,
            SynchronizerLease.token == token,
        )
        .values(expires_at=now + timedelta(seconds=ttl_s))
    )
    return result.rowcount == 1


def release_lease(session: Session, run_id: str, holder: str, token: int, now: datetime, *, shard: int = 0) -> None:
    session.execute(
        update(SynchronizerLease)
        .where(SynchronizerLease.run_id == run_id, SynchronizerLease.shard == shard, SynchronizerLease.holder == holder,
               SynchronizerLease.token == token)
        .values(expires_at=now)
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


# --- versions and merges -------------------------------------------------------------------------


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


def latest_versions(session: Session, run_id: str) -> dict[int, FragmentHead]:
    """The newest published version of every fragment (its head row: the version's own columns)."""
    return {h.fragment: h for h in session.scalars(select(FragmentHead).where(FragmentHead.run_id == run_id))}


def latest_version_numbers(session: Session, run_id: str) -> dict[int, int]:
    return dict(session.execute(select(FragmentHead.fragment, FragmentHead.version).where(FragmentHead.run_id == run_id)).all())


def get_version(session: Session, run_id: str, fragment: int, version: int) -> FragmentVersion | None:
    return session.get(FragmentVersion, (run_id, fragment, version))


def _lease_holds(session: Session, run_id: str, holder: str, token: int, now: datetime, shard: int, *, lock: bool = True) -> Any:
    """EXISTS: ``holder`` holds the lease of the run's ``shard`` with ``token`` at ``now``. With ``lock``, on PostgreSQL the lease
    row is share-locked, so a takeover waits until this transaction has committed (the fence of a publish)."""
    stmt = select(SynchronizerLease.run_id).where(
        SynchronizerLease.run_id == run_id,
        SynchronizerLease.shard == shard,
        SynchronizerLease.holder == holder,
        SynchronizerLease.token == token,
        SynchronizerLease.expires_at > now,
    )
    return exists(stmt.with_for_update(read=True) if lock else stmt)


def _refuse_publish(session: Session, run_id: str, fragment: int, version: int, holder: str, token: int, now: datetime,
                    shard: int) -> None:
    """Why a publish wrote nothing: the lease, else the version (raises; returns when neither is the cause)."""
    # A plain read: the publish may already share-lock the lease row, and upgrading that lock would deadlock
    # with a concurrent publish that holds one too.
    if not session.scalar(select(_lease_holds(session, run_id, holder, token, now, shard, lock=False))):
        raise LeaseLostError(f"{holder} (token {token}) does not hold the {_shard_label(shard)}lease of run {run_id!r}")
    current = session.scalar(
        select(FragmentHead.version).where(FragmentHead.run_id == run_id, FragmentHead.fragment == fragment)
    )
    expected = 0 if current is None else current + 1
    if version != expected:
        raise VersionConflictError(f"fragment {fragment}: cannot publish v{version}, the next version is v{expected}")


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
        merge_id = conn.execute(
            insert(Merge.__table__)
            .values(
                run_id=run_id, fragment=fragment, version=version, at=now, quorum=record.quorum,
                live_learners=record.live_learners, included=len(merged), rejected=len(rejected),
                grace_window_s=record.grace_window_s, grace_waited_s=record.grace_waited_s, merge_s=record.merge_s,
                reason=record.reason, detail_json=json.dumps(record.detail),
            )
            .returning(Merge.__table__.c.id)
        ).scalar_one()
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
        changed = conn.execute(stmt, params).rowcount
        if changed != len(merged):
            _refuse_publish(session, run_id, fragment, version, holder, token, now, shard)
            raise AlreadyDecidedError(
                f"{len(merged) - changed} of the submissions to merge are not pending: refusing to merge them twice"
            )
    for sub_id, reason in rejected:
        _decide_rejected(session, run_id, [sub_id], reason, now)
    if version > 0:
        _advance_head(session, run_id, fragment, version, head_values, holder, token, now, shard)
    conn.execute(
        insert(FragmentVersion.__table__).values(
            run_id=run_id, fragment=fragment, version=version, created_at=now, blob_key=blob.key, sha256=blob.sha256,
            nbytes=blob.nbytes, state_key=state.key, state_sha256=state.sha256, lease_token=token, synchronizer=holder,
            blob_deleted=False, gc_done=False, compact_json=compact_json,
        )
    )
    return merge_id


def _advance_head(
    session: Session, run_id: str, fragment: int, version: int, values: dict[str, Any], holder: str, token: int, now: datetime,
    shard: int,
) -> None:
    """Move the fragment's head from ``version - 1`` to ``version`` under the lease, adding what this version merged."""
    heads = FragmentHead.__table__.alias("others")
    merged_here = (Submission.run_id == run_id) & (Submission.fragment == fragment) & (Submission.merged_version == version) & (
        Submission.status == MERGED
    )
    # The wait since the run's previous merged version, whichever fragment it was (summary: longest downtime).
    gap = now.timestamp() - select(func.max(heads.c.published_s)).where(heads.c.run_id == run_id, heads.c.version > 0).scalar_subquery()
    result = session.connection().execute(
        update(FragmentHead.__table__)
        .where(
            FragmentHead.run_id == run_id,
            FragmentHead.fragment == fragment,
            FragmentHead.version == version - 1,
            _lease_holds(session, run_id, holder, token, now, shard),
        )
        .values(
            **values,
            tokens_merged=FragmentHead.tokens_merged
            + select(func.coalesce(func.sum(Submission.tokens_new), 0)).where(merged_here).scalar_subquery(),
            submissions_merged=FragmentHead.submissions_merged + select(func.count()).where(merged_here).scalar_subquery(),
            longest_gap_s=case((gap > FragmentHead.longest_gap_s, gap), else_=FragmentHead.longest_gap_s),
        )
    )
    if result.rowcount != 1:
        _refuse_publish(session, run_id, fragment, version, holder, token, now, shard)
        raise LedgerError(f"fragment {fragment}: v{version} was refused")


def reject_submissions(
    session: Session, run_id: str, rejected: Sequence[tuple[int, str]], *, holder: str, token: int, now: datetime,
    shard: int = 0,
) -> None:
    """Reject submissions outside a merge (e.g. every pending one failed validation)."""
    _check_fence(session, run_id, holder, token, now, shard)
    for sub_id, reason in rejected:
        _decide_rejected(session, run_id, [sub_id], reason, now)
        record_event(session, run_id, "submission_rejected", holder, f"submission {sub_id}: {reason}", now)


GC_BATCH = 2_000
"""Most versions or submissions one garbage-collection pass settles: a pass stays short whatever the backlog."""


def versions_for_gc(
    session: Session, run_id: str, keep_last: int, checkpoint_every: int, limit: int = GC_BATCH
) -> list[FragmentVersion]:
    """Published versions whose blobs the retention policy lets go.

    Reads only versions GC has not settled yet (a partial index holds just those); the ones kept for good
    (every ``checkpoint_every``-th) are marked settled here, so no later pass reads them again."""
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


# --- events and evaluations ----------------------------------------------------------------------


LEARNER_JOINED = "learner_joined"
LEARNER_RESTARTED = "learner_restarted"
LEARNER_LAUNCHED = "learner_launched"
"""A supervisor started a learner's process (its actor is the learner)."""
LEARNER_EXITED = "learner_exited"
"""A supervisor saw a learner's process end, or ended it (its actor is the learner)."""


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


def decided_tokens(session: Session, run_id: str) -> dict[str, int]:
    """Tokens by fate from running totals and a small set: merged from the fragment heads, rejected from the
    run's row, pending summed over just the pending rows (the poll index) — never every submission."""
    merged = session.scalar(select(func.coalesce(func.sum(FragmentHead.tokens_merged), 0)).where(FragmentHead.run_id == run_id))
    pending = session.scalar(
        select(func.coalesce(func.sum(Submission.tokens_new), 0)).where(Submission.run_id == run_id, Submission.status == PENDING)
    )
    rejected = session.scalar(select(Run.tokens_rejected).where(Run.id == run_id))
    return {MERGED: int(merged or 0), PENDING: int(pending or 0), REJECTED: int(rejected or 0)}


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
    try:
        config = json.loads(run.config_json) if run.config_json else {}
    except ValueError:
        config = {}
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
        config=config if isinstance(config, dict) else {},
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


# --- where each learner's seconds went ---------------------------------------------------------------

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
    found = session.execute(
        select(Event.actor, Event.kind, Event.at)
        .where(Event.run_id == run_id, Event.kind.in_(list(_TIMELINE_KINDS)))
        .order_by(Event.at, Event.id)
    )
    for actor, kind, at in found:
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
