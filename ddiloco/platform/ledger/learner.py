"""What a learner calls: registration, heartbeats, its submissions in and the one round trip per step that registers
them, beats and reads the fragments' newest versions. Each function takes a Session and never opens one."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import Integer, String, Text, TextClause, bindparam, case, cast, func, insert, literal, select, text, update
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session

from ddiloco.platform.config import CODECS, world_size_problem
from ddiloco.platform.ids import validate_id
from ddiloco.platform.ledger._common import INT64_MAX, check_count, check_figure, check_seconds, column_problem
from ddiloco.platform.ledger.errors import SubmissionConflictError, WorldSizeError
from ddiloco.platform.ledger.models import (
    PENDING,
    Event,
    FragmentHead,
    Heartbeat,
    Learner,
    Run,
    Submission,
)
from ddiloco.platform.ledger.rejections import decide_rejected
from ddiloco.platform.ledger.runs import LEARNER_JOINED, LEARNER_RESTARTED, record_event

# --- registration and heartbeats ------------------------------------------------------------------


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
    check_count(world_size, "world_size", least=1)
    if pid is not None:
        check_count(pid, "pid")
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
    check_beat(step, tokens, tokens_per_s, step_time_s, busy_s)
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


def set_optimizer_state(session: Session, run_id: str, learner_id: str, key: str, sha256: str) -> str | None:
    """Point a learner at its newest saved optimizer state; returns the key it replaces."""
    learner = session.get(Learner, (run_id, learner_id))
    if learner is None:
        return None
    old = learner.optimizer_state_key
    learner.optimizer_state_key = key
    learner.optimizer_state_sha256 = sha256
    return old


MOST_FLOPS_PER_S = 1e18
"""Above any device's model FLOP/s (the largest GPUs' dense peaks are a few 1e15)."""
MOST_MFU = 100.0
"""Far above an honest MFU (at most 1 against a right peak): room for a peak table that is off, none for nonsense."""


def check_beat(step: int, tokens: int, tokens_per_s: float, step_time_s: float, busy_s: float,
               model_flops_per_s: float | None = None, mfu: float | None = None) -> None:
    """A heartbeat's figures as a learner writes them (counts from 0, finite rates and times from 0), else an
    InvalidArgumentError: the dashboard, the straggler rule and the grace window read them back."""
    check_count(step, "step", most=INT64_MAX), check_count(tokens, "tokens", most=INT64_MAX)
    check_seconds(tokens_per_s, "tokens_per_s", positive=False, most=1e18)
    check_seconds(step_time_s, "step_time_s", positive=False), check_seconds(busy_s, "busy_s", positive=False)
    if model_flops_per_s is not None:
        check_figure(model_flops_per_s, "model_flops_per_s", most=MOST_FLOPS_PER_S)
    if mfu is not None:
        check_figure(mfu, "mfu", most=MOST_MFU)


# --- submissions ----------------------------------------------------------------------------------


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
        why = column_problem(Submission, self.__dict__) or column_problem(
            Learner, {"inc_tokens_trained": self.tokens_total, "data_batches": self.data_batches})
        if self.tokens_total < 0 or (self.data_batches or 0) < 0:
            why = why or f"tokens_total={self.tokens_total}, data_batches={self.data_batches}: a count from 0"
        if why:
            raise ValueError(f"submission {self.uid!r}: implausible counts ({why})")
        if self.codec not in CODECS:
            raise ValueError(f"submission {self.uid!r}: codec {self.codec[:24]!r} is none of {', '.join(CODECS)}")


def register_submission(
    session: Session, run_id: str, learner_id: str, incarnation: int, sub: SubmissionIn, now: datetime
) -> tuple[int, bool]:
    """Register a submission after its blob is written. Returns (id, created); a repeat uid is a no-op."""
    return register_submissions(session, run_id, learner_id, incarnation, [sub], now)[0]


SUBMISSION_COLUMNS = ("run_id", "learner_id", "uid", "fragment", "base_version", "c_steps", "c_tokens", "tokens_new", "blob_key",
                      "sha256", "nbytes", "codec", "created_at", "status", "blob_deleted")
"""What registering a submission writes (the rest of its row is the synchronizer's)."""
INSERT_ROWS = 32
"""Most submissions one INSERT statement carries (a larger registration takes several)."""


@functools.cache
def _submission_insert(rows: int) -> TextClause:
    """INSERT of ``rows`` submissions, repeats skipped, returning (id, uid) of those written — as text, built once per row
    count. SQLAlchemy cannot cache the dialects' INSERT … ON CONFLICT (it has no cache key) and compiled it anew at every
    registration: the upload thread's largest piece of SQL work. The statement is the same on SQLite and PostgreSQL."""
    table = Submission.__table__
    values = ", ".join("(" + ", ".join(f":{c}_{i}" for c in SUBMISSION_COLUMNS) + ")" for i in range(rows))
    return (
        text(f"INSERT INTO {table.name} ({', '.join(SUBMISSION_COLUMNS)}) VALUES {values} "
             "ON CONFLICT (run_id, learner_id, uid) DO NOTHING RETURNING id, uid")
        .bindparams(*(bindparam(f"{c}_{i}", type_=table.c[c].type) for i in range(rows) for c in SUBMISSION_COLUMNS))
        .columns(table.c.id, table.c.uid)
    )


def _insert_submissions(
    session: Session, run_id: str, learner_id: str, subs: Sequence[SubmissionIn], now: datetime
) -> tuple[list[tuple[int, bool]], list[SubmissionIn], dict[str, int]]:
    """Insert the submissions (repeats are no-ops): (id, created) per submission, the new ones, their ids by uid."""
    if not subs:
        return [], [], {}
    created: dict[str, int] = {}
    for first in range(0, len(subs), INSERT_ROWS):
        chunk = subs[first:first + INSERT_ROWS]
        params: dict[str, Any] = {}
        for i, sub in enumerate(chunk):
            params.update({
                f"run_id_{i}": run_id, f"learner_id_{i}": learner_id, f"uid_{i}": sub.uid, f"fragment_{i}": sub.fragment,
                f"base_version_{i}": sub.base_version, f"c_steps_{i}": sub.c_steps, f"c_tokens_{i}": sub.c_tokens,
                f"tokens_new_{i}": sub.tokens_new, f"blob_key_{i}": sub.blob_key, f"sha256_{i}": sub.sha256,
                f"nbytes_{i}": sub.nbytes, f"codec_{i}": sub.codec, f"created_at_{i}": now, f"status_{i}": PENDING,
                f"blob_deleted_{i}": False,
            })
        created.update({uid: sub_id for sub_id, uid in session.connection().execute(_submission_insert(len(chunk)), params).all()})
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


def _registration_params(new: Sequence[SubmissionIn], now: datetime) -> dict[str, Any]:
    """The bound values of what registering ``new`` adds to its learner's row (:func:`_learner_update`)."""
    positions = [sub.data_batches for sub in new if sub.data_batches is not None]
    return {
        "x_tokens_new": sum(sub.tokens_new for sub in new), "x_trained": max(sub.tokens_total for sub in new),
        "x_count": len(new), "x_nbytes": sum(sub.nbytes for sub in new), "x_now": now,
        **({"x_data_batches": max(positions)} if positions else {}),
    }


@functools.cache
def _learner_update(dialect: str, registers: bool, positions: bool, beats: bool, loss: bool, returns: bool, known: bool) -> Any:
    """The UPDATE of a learner's row that a registration (``registers``, with a data position: ``positions``) and a beat
    (``beats``, with a loss: ``loss``) make, optionally returning the run's status and the fragment heads (newer than the
    bound ``x_known`` when ``known``) — built once per shape with bound parameters, so SQLAlchemy's compiled cache is hit
    without working out the statement's cache key again each step (its parameters: :func:`_registration_params`,
    :func:`learner_exchange`)."""
    L = Learner.__table__.c
    greatest = func.max if dialect == "sqlite" else func.greatest

    def bound(name: str, column: str) -> Any:
        return bindparam(name, type_=L[column].type)

    values: dict[str, Any] = {}
    if registers:
        values.update(
            inc_tokens_submitted=L.inc_tokens_submitted + bound("x_tokens_new", "inc_tokens_submitted"),
            submissions=L.submissions + bound("x_count", "submissions"),
            tokens_sent=L.tokens_sent + bound("x_tokens_new", "tokens_sent"),
            bytes_sent=L.bytes_sent + bound("x_nbytes", "bytes_sent"),
            last_submission_at=bound("x_now", "last_submission_at"),
        )
        if positions:
            values["data_batches"] = bound("x_data_batches", "data_batches")
    if registers or beats:
        values["inc_tokens_trained"] = greatest(L.inc_tokens_trained, bound("x_trained", "inc_tokens_trained"))
    if beats:
        values.update(
            last_heartbeat_at=bound("x_now", "last_heartbeat_at"),
            busy_s=L.busy_s + bound("x_busy_s", "busy_s"),
            status=case((L.status == "dead", "recovering"), else_=L.status),
            **{c: bound(f"x_{c}", c) for c in BEAT_COLUMNS},
        )
        if loss:
            values["loss"] = bound("x_loss", "loss")
    stmt = (
        update(Learner.__table__)
        .where(L.run_id == bindparam("x_run", type_=L.run_id.type), L.id == bindparam("x_learner", type_=L.id.type),
               L.incarnation == bindparam("x_incarnation", type_=L.incarnation.type))
        # An update must set something: a bare poll rewrites the incarnation with itself.
        .values(**(values or {"incarnation": L.incarnation}))
    )
    if returns:
        status = select(Run.status).where(Run.id == bindparam("x_run")).scalar_subquery()
        stmt = stmt.returning(status, _heads_json(dialect, known))
    return stmt


BEAT_COLUMNS = ("step", "tokens_per_s", "step_time_s", "queue_depth", "oldest_unsent_s", "link_json", "model_flops_per_s", "mfu")
"""What a beat writes to its learner's row as it is (beside the heartbeat time, tokens trained, busy seconds and loss)."""


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
        decide_rejected(session, run_id, ids, reason, now)
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
    params = {"x_run": run_id, "x_learner": learner_id, "x_incarnation": incarnation, **_registration_params(new, now)}
    stmt = _learner_update(session.get_bind().dialect.name, True, "x_data_batches" in params, False, False, False, False)
    updated = session.connection().execute(stmt, params).rowcount
    if updated != 1:
        _reject_superseded(session, run_id, learner_id, incarnation, new, created, now)
    return out


# --- the learner's one round trip per step --------------------------------------------------------


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
    model_flops_per_s: float | None = None
    """One device's model FLOP/s (forward and backward), None where the model was not counted."""
    mfu: float | None = None
    """That against the device's published peak, None where none is known."""

    def __post_init__(self) -> None:
        check_beat(self.step, self.tokens, self.tokens_per_s, self.step_time_s, self.busy_s, self.model_flops_per_s, self.mfu)

    def live_values(self) -> dict[str, Any]:
        """The columns a learner's row and a heartbeat row both take from the beat as they are (:data:`BEAT_COLUMNS`)."""
        return {"step": self.step, "tokens_per_s": self.tokens_per_s, "step_time_s": self.step_time_s,
                "queue_depth": self.queue_depth, "oldest_unsent_s": self.oldest_unsent_s, "link_json": self.link_json,
                "model_flops_per_s": self.model_flops_per_s, "mfu": self.mfu}


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


def _heads_json(dialect: str, known: bool) -> Any:
    """The fragment heads of run ``x_run`` (newer than ``x_known`` when ``known``: a JSON object fragment -> version the
    caller has seen) as one JSON array, so the learner's row update returns them in the same statement — and a learner
    polling several times a second is not sent the same heads again each time."""
    h = FragmentHead
    seen = bindparam("x_known", type_=Text)
    if dialect == "sqlite":
        agg = func.json_group_array(func.json_array(h.fragment, h.version, h.blob_key, h.sha256, h.nbytes, h.compact_json))
        had = func.json_extract(seen, literal('$."') + cast(h.fragment, String) + literal('"'))
    else:
        agg = func.json_agg(func.json_build_array(h.fragment, h.version, h.blob_key, h.sha256, h.nbytes, h.compact_json))
        had = func.jsonb_extract_path_text(cast(seen, postgresql.JSONB), cast(h.fragment, Text))
    where = [h.run_id == bindparam("x_run")]
    if known:
        where.append(h.version > func.coalesce(cast(had, Integer), -1))
    return select(agg).where(*where).scalar_subquery()


def _parse_heads(raw: Any) -> dict[int, HeadRef]:
    items = json.loads(raw) if isinstance(raw, str | bytes) else (raw or [])
    return {int(f): HeadRef(int(f), int(v), str(k), str(sha), int(n), None if c is None else str(c)) for f, v, k, sha, n, c in items}


_HEARTBEAT_INSERT = insert(Heartbeat.__table__)
_EVENT_INSERT = insert(Event.__table__)


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
    params: dict[str, Any] = {"x_run": run_id, "x_learner": learner_id, "x_incarnation": incarnation}
    if new:
        params.update(_registration_params(new, now))
    if beat is not None:
        params.update(x_now=now, x_trained=max([beat.tokens, *(sub.tokens_total for sub in new)]), x_busy_s=beat.busy_s,
                      **{f"x_{c}": v for c, v in beat.live_values().items()})
        if beat.loss is not None:
            params["x_loss"] = beat.loss
    if known is not None:
        params["x_known"] = json.dumps({str(int(f)): int(v) for f, v in known.items()})
    stmt = _learner_update(session.get_bind().dialect.name, bool(new), "x_data_batches" in params, beat is not None,
                           "x_loss" in params, True, known is not None)
    row = session.connection().execute(stmt, params).first()
    if row is None:
        if new:
            _reject_superseded(session, run_id, learner_id, incarnation, new, created, now)
        run_status = session.scalar(select(Run.status).where(Run.id == run_id))
        return Exchange(out, False, run_status, read_heads(session, run_id))
    if beat is not None and beat.history:
        session.connection().execute(_HEARTBEAT_INSERT, {
            "run_id": run_id, "learner_id": learner_id, "incarnation": incarnation, "at": now, "tokens": beat.tokens,
            "loss": beat.loss, **beat.live_values(),
        })
    if events:
        session.connection().execute(
            _EVENT_INSERT, [{"run_id": run_id, "at": now, "kind": k, "actor": learner_id, "detail": d} for k, d in events]
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
