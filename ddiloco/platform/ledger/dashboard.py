"""What the dashboard reads beyond a run's summary (``reports``): its learners' rows and fates, the synchronizers
that published, the version timeline, the newest merges, events and rejections, the staleness histogram and the
loss curves sampled on a time grid. Plain rows, no frames (those are the dashboard's own, ``ui.queries``).

Every read costs the same at any length of history, and is planned the same on SQLite with no statistics, with
current ones or with stale ones, and on PostgreSQL (``tests/test_report_plans.py``): single-table statements or
correlated seeks whose best index is the only one that fits — totals come from running totals, lists are the
newest few by index, curves are seeks on a grid. Statements of plain columns run on the session's connection:
the ORM's per-execution work would cost more than the reads."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from sqlalchemy import DateTime, bindparam, func, select, true, union_all
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session

from ddiloco.platform.fragments import shard_fragments
from ddiloco.platform.ledger.models import (
    PENDING,
    REJECTED_ROWS,
    Evaluation,
    Event,
    FragmentHead,
    FragmentSpec,
    FragmentVersion,
    Heartbeat,
    Learner,
    Merge,
    Run,
    Submission,
    SynchronizerLease,
    UtcDateTime,
)
from ddiloco.platform.ledger.reports import rejected_totals
from ddiloco.platform.ledger.runs import get_run, recorded_config, recorded_shards

LOSS_POINTS_BUDGET = 4_000
"""Training-loss points for all learners together (the chart stays responsive)."""
LOSS_POINTS_PER_LEARNER = 200
MAX_GRID_POINTS = 400
"""SQLite allows 500 terms in a compound SELECT; the sampling grid stays below."""
VERSION_POINTS = 1_500
"""Points of the version timeline (all fragments): enough for its lines, few enough to read by key each refresh."""
EVALUATION_POINTS = 200
STALENESS_VERSIONS = 100
"""The staleness histogram counts the submissions merged into each fragment's newest this-many versions."""
HOLDER_TOKENS = 20
"""The lease-holder table shows the newest this-many fencing tokens."""
MERGES_SHOWN = 2_000
EVENTS_SHOWN = 500
REJECTIONS_SHOWN = 200


def run_ids(session: Session) -> list[str]:
    """Every run, newest first."""
    return list(session.scalars(select(Run.id).order_by(Run.created_at.desc(), Run.id)))


# --- learners -----------------------------------------------------------------------------------------


def learner_rows(session: Session, run_id: str) -> list[Any]:
    """The run's learners, region by region, with the newest loss each reported, its submission totals and its link."""
    # Named columns, not the entity: only what the page shows is read.
    return list(
        session.connection().execute(
            select(
                Learner.id, Learner.region, Learner.status, Learner.incarnation, Learner.started_at, Learner.last_heartbeat_at,
                Learner.step, Learner.tokens_per_s, Learner.step_time_s, Learner.tokens_trained, Learner.tokens_lost,
                Learner.inc_tokens_trained, Learner.inc_tokens_submitted, Learner.busy_s, Learner.flow_run_url, Learner.loss,
                Learner.submissions, Learner.tokens_sent, Learner.last_submission_at, Learner.queue_depth,
                Learner.oldest_unsent_s, Learner.link_json, Learner.model_flops_per_s, Learner.mfu,
            )
            .where(Learner.run_id == run_id)
            .order_by(Learner.region, Learner.id)
        )
    )


@dataclass(frozen=True)
class Fates:
    """What became of one learner's submissions, and the tokens merged."""

    merged: int = 0
    rejected: int = 0
    pending: int = 0
    tokens_merged: int = 0


def learner_fates(session: Session, run_id: str, learners: list[Any]) -> dict[str, Fates]:
    """Per learner: pending summed over just those rows (the poll index), rejected from the rejections' running
    totals; merged is the rest of what the learner's row says it registered — no scan of the merged or rejected."""
    # Summed here, not by GROUP BY learner_id: that would tempt the planner into walking the (run, learner, uid)
    # index over every submission instead of seeking the few pending ones.
    pending: dict[str, tuple[int, int]] = {}
    rows = session.connection().execute(
        select(Submission.learner_id, Submission.tokens_new).where(Submission.run_id == run_id, Submission.status == PENDING)
    )
    for lid, tokens in rows:
        n, t = pending.get(lid, (0, 0))
        pending[lid] = (n + 1, t + int(tokens))
    rejected: dict[str, tuple[int, int]] = {}
    for total in rejected_totals(session, run_id):
        n, t = rejected.get(total.learner_id, (0, 0))
        rejected[total.learner_id] = (n + total.submissions, t + total.tokens)
    out = {}
    for row in learners:
        p, r = pending.get(row.id, (0, 0)), rejected.get(row.id, (0, 0))
        out[row.id] = Fates(
            merged=int(row.submissions) - p[0] - r[0], rejected=r[0], pending=p[0],
            tokens_merged=int(row.tokens_sent) - p[1] - r[1],
        )
    return out


# --- synchronizers --------------------------------------------------------------------------------------


class HolderTerm(NamedTuple):
    """What one fencing token of one shard published."""

    shard: int
    holder: str
    token: int
    versions: int
    first_publish: datetime
    last_publish: datetime


def synchronizer_holders(session: Session, run_id: str, tokens: int = HOLDER_TOKENS) -> list[HolderTerm]:
    """The synchronizers that published for this run (per shard, its newest ``tokens`` fencing tokens), by shard and
    token. Per token and fragment the versions are one contiguous range (tokens never go back), so a few index seeks
    per fragment find it — never a count over the versions."""
    newest = dict(session.execute(select(SynchronizerLease.shard, SynchronizerLease.token).where(SynchronizerLease.run_id == run_id)).all())
    shard_of = _fragment_shards(session, run_id) if newest else {}
    out = []
    for shard, top in sorted(newest.items()):
        for token in range(max(0, int(top) - tokens) + 1, int(top) + 1):
            ranges = [r for r in session.connection().execute(_token_ranges(run_id, token)).all()
                      if r[0] is not None and shard_of.get(r[5], 0) == shard]
            if ranges:
                out.append(HolderTerm(shard, ranges[0][4], token, sum(r[1] - r[0] + 1 for r in ranges),
                                      min(r[2] for r in ranges), max(r[3] for r in ranges)))
    return out


def _fragment_shards(session: Session, run_id: str) -> dict[int, int]:
    """Each fragment's synchronizer shard, from the run's recorded config and fragment sizes ({} for one shard)."""
    run = get_run(session, run_id)
    shards = recorded_shards(recorded_config(run)) if run is not None else 1
    if shards == 1:
        return {}
    sizes = dict(session.execute(select(FragmentSpec.fragment, FragmentSpec.nbytes).where(FragmentSpec.run_id == run_id)).all())
    if sorted(sizes) != list(range(len(sizes))) or shards > len(sizes):
        return {}
    return {f: k for k, frags in enumerate(shard_fragments([sizes[f] for f in range(len(sizes))], shards)) for f in frags}


def _token_ranges(run_id: str, token: int) -> Any:
    """Per fragment: (first version, last version, first publish, last publish, holder, fragment) under ``token``."""
    fv = FragmentVersion

    def seek(column: Any, newest: bool) -> Any:
        return (
            select(column)
            .where(fv.run_id == run_id, fv.lease_token == token, fv.fragment == FragmentHead.fragment)
            .order_by(fv.version.desc() if newest else fv.version)
            .limit(1)
            .correlate(FragmentHead)
            .scalar_subquery()
        )

    return select(
        seek(fv.version, False), seek(fv.version, True), seek(fv.created_at, False), seek(fv.created_at, True),
        seek(fv.synchronizer, False), FragmentHead.fragment,
    ).where(FragmentHead.run_id == run_id)


# --- versions, merges, staleness --------------------------------------------------------------------------


_VERSIONS_BY_KEY = (
    select(FragmentVersion.fragment, FragmentVersion.version, FragmentVersion.created_at)
    .where(
        FragmentVersion.run_id == bindparam("run"),
        FragmentVersion.fragment.in_(bindparam("fragments", expanding=True)),
        FragmentVersion.version.in_(bindparam("versions", expanding=True)),
    )
)


def version_timeline(session: Session, run_id: str, max_points: int = VERSION_POINTS) -> list[tuple[int, int, datetime]]:
    """(fragment, version, at) by fragment and version; thinned to every k-th version when there are more than
    ``max_points`` (each fragment's newest, from its head, always kept): primary-key seeks, never a scan."""
    heads = session.connection().execute(
        select(FragmentHead.fragment, FragmentHead.version, FragmentHead.created_at).where(FragmentHead.run_id == run_id)
    ).all()
    if not heads:
        return []
    total = sum(h.version + 1 for h in heads)
    k = max(1, math.ceil(total / max_points))
    rows = {(h.fragment, h.version): tuple(h) for h in heads}
    wanted = list(range(0, max(h.version for h in heads) + 1, k))
    for start in range(0, len(wanted), 500):
        params = {"run": run_id, "fragments": [h.fragment for h in heads], "versions": wanted[start:start + 500]}
        rows.update({(r.fragment, r.version): tuple(r) for r in session.connection().execute(_VERSIONS_BY_KEY, params)})
    return [rows[key] for key in sorted(rows)]


MERGE_FIELDS = ("at", "fragment", "version", "quorum", "live_learners", "included", "rejected", "grace_window_s",
                "grace_waited_s", "merge_s", "reason")


def newest_merges(session: Session, run_id: str, limit: int = MERGES_SHOWN) -> list[tuple]:
    """The newest ``limit`` merges (``MERGE_FIELDS``), oldest first: quorum, grace window and wait, what was included."""
    rows = session.connection().execute(
        select(*(getattr(Merge, name) for name in MERGE_FIELDS))
        .where(Merge.run_id == run_id)
        .order_by(Merge.at.desc(), Merge.id.desc())
        .limit(limit)
    ).all()
    return [tuple(r) for r in reversed(rows)]


SQLITE_COMPOUND_TERMS = 400
"""Branches of one UNION ALL on SQLite (it allows 500)."""


@functools.cache
def _merged_since(fragments: int) -> Any:
    """Staleness of what fragment ``f{i}`` merged after version ``lo{i}``, a branch per fragment: each branch seeks
    one fragment's range of ``ix_submissions_fragment_version`` and can be planned no other way."""
    # No status term: only a merge sets merged_version (``ledger check`` holds every submission to one fate), and
    # status = 'merged' would let the (run, status, fragment) poll index match one more column and win without
    # statistics, walking every merged submission of the fragment.
    branches = [
        select(Submission.staleness).where(
            Submission.run_id == bindparam("run"), Submission.fragment == bindparam(f"f{i}"),
            Submission.merged_version > bindparam(f"lo{i}"), Submission.staleness.is_not(None),
        )
        for i in range(fragments)
    ]
    merged = union_all(*branches).subquery() if fragments > 1 else branches[0].subquery()
    return select(merged.c.staleness, func.count()).group_by(merged.c.staleness)


def staleness_counts(session: Session, run_id: str, versions: int = STALENESS_VERSIONS) -> list[tuple[int, int]]:
    """(versions behind, submissions) of what was merged into each fragment's newest ``versions`` versions, by staleness:
    an index range per fragment, whatever the history."""
    heads = session.connection().execute(
        select(FragmentHead.fragment, FragmentHead.version).where(FragmentHead.run_id == run_id)
    ).all()
    counts: dict[int, int] = {}
    for start in range(0, len(heads), SQLITE_COMPOUND_TERMS):
        chunk = heads[start:start + SQLITE_COMPOUND_TERMS]
        params: dict[str, Any] = {"run": run_id}
        for i, (fragment, head) in enumerate(chunk):
            params[f"f{i}"], params[f"lo{i}"] = fragment, head - versions
        for staleness, n in session.connection().execute(_merged_since(len(chunk)), params):
            counts[int(staleness)] = counts.get(int(staleness), 0) + int(n)
    return sorted(counts.items())


# --- curves sampled on a time grid ----------------------------------------------------------------------


@functools.cache
def _grid(points: int) -> Any:
    """A CTE of ``points`` typed timestamps ``t`` bound as ``t0``, ``t1``, … (UNION ALL terms: portable to SQLite
    and PostgreSQL, and typed, so they compare the way the ledger stores times). Built once per size: a
    statement built anew at every refresh costs more than its index seeks."""
    return union_all(*[select(bindparam(f"t{i}", type_=UtcDateTime()).label("t")) for i in range(points)]).cte("grid")


# PostgreSQL takes the grid as one array: planning a few hundred UNION ALL terms cost more than the seeks (17-30 ms of
# a 35-85 ms statement), and a LATERAL seek reads each picked row once, where the scalar subquery ran twice per point.
_PG_GRID = func.unnest(bindparam("ts", type_=postgresql.ARRAY(DateTime(timezone=True)))).table_valued("t").render_derived(name="grid")


def _grid_times(first: datetime, last: datetime, points: int, dialect: str = "sqlite") -> dict[str, Any]:
    span = max(0.0, (last - first).total_seconds())
    times = [first + timedelta(seconds=span * i / (points - 1)) for i in range(points)]
    return {"ts": times} if dialect == "postgresql" else {f"t{i}": t for i, t in enumerate(times)}


EVALUATION_FIELDS = ("at", "tokens", "versions_total", "val_loss", "val_accuracy")
_EVALUATION_COLUMNS = tuple(getattr(Evaluation, name) for name in EVALUATION_FIELDS)


@functools.cache
def _evaluations_on_grid(points: int, dialect: str = "sqlite") -> Any:
    if dialect == "postgresql":
        pick = (
            select(Evaluation.id, *_EVALUATION_COLUMNS)
            .where(Evaluation.run_id == bindparam("run"), Evaluation.at <= _PG_GRID.c.t)
            .order_by(Evaluation.at.desc(), Evaluation.id.desc())
            .limit(1)
            .lateral("pick")
        )
        return select(pick).select_from(_PG_GRID).join(pick, true())
    grid = _grid(points)
    newest = (
        select(Evaluation.id)
        .where(Evaluation.run_id == bindparam("run"), Evaluation.at <= grid.c.t)
        .order_by(Evaluation.at.desc(), Evaluation.id.desc())
        .limit(1)
        .correlate(grid)
        .scalar_subquery()
    )
    picks = select(newest.label("id")).select_from(grid).subquery()
    return select(Evaluation.id, *_EVALUATION_COLUMNS).join(picks, picks.c.id == Evaluation.id)


@functools.cache
def _losses_on_grid(points: int, dialect: str = "sqlite") -> Any:
    if dialect == "postgresql":
        pick = (
            select(Heartbeat.incarnation, Heartbeat.step, Heartbeat.at, Heartbeat.loss, Heartbeat.tokens_per_s, Heartbeat.mfu)
            .where(Heartbeat.run_id == bindparam("run"), Heartbeat.learner_id == Learner.id, Heartbeat.at <= _PG_GRID.c.t)
            .order_by(Heartbeat.at.desc())
            .limit(1)
            .lateral("pick")
        )
        return (
            select(Learner.id.label("learner"), Learner.region, pick.c.incarnation, pick.c.step, pick.c.at, pick.c.loss,
                   pick.c.tokens_per_s, pick.c.mfu)
            .select_from(Learner)
            .join(_PG_GRID, true())
            .join(pick, true())
            .where(Learner.run_id == bindparam("run"), pick.c.loss.is_not(None))
            .distinct()
        )
    grid = _grid(points)
    newest = (
        select(Heartbeat.id)
        .where(Heartbeat.run_id == bindparam("run"), Heartbeat.learner_id == Learner.id, Heartbeat.at <= grid.c.t)
        .order_by(Heartbeat.at.desc())
        .limit(1)
        .correlate(Learner, grid)
        .scalar_subquery()
    )
    picks = (
        select(Learner.id.label("learner"), Learner.region.label("region"), newest.label("hb"))
        .select_from(Learner)
        .join(grid, true())
        .where(Learner.run_id == bindparam("run"))
        .subquery()
    )
    return (
        select(picks.c.learner, picks.c.region, Heartbeat.incarnation, Heartbeat.step, Heartbeat.at, Heartbeat.loss,
               Heartbeat.tokens_per_s, Heartbeat.mfu)
        .join(Heartbeat, Heartbeat.id == picks.c.hb)
        .where(Heartbeat.loss.is_not(None))
        .distinct()
    )


def evaluation_samples(session: Session, run_id: str, points: int = EVALUATION_POINTS) -> list[tuple]:
    """Validation over the run (``EVALUATION_FIELDS``) in the order recorded: the newest evaluation at or before each
    time of a grid (index seeks), plus the first and the last, so a long run costs ``points`` rows, not one each."""
    points = max(2, min(points, MAX_GRID_POINTS))
    base = select(Evaluation.id, *_EVALUATION_COLUMNS).where(Evaluation.run_id == run_id)
    few = session.connection().execute(base.order_by(Evaluation.at, Evaluation.id).limit(points + 1)).all()
    if len(few) <= points:  # every evaluation fits: all of them
        return [tuple(r[1:]) for r in few]
    first = few[0]
    last = session.connection().execute(base.order_by(Evaluation.at.desc(), Evaluation.id.desc()).limit(1)).one()
    dialect = session.get_bind().dialect.name
    rows = session.connection().execute(
        _evaluations_on_grid(points, dialect), {"run": run_id, **_grid_times(first.at, last.at, points, dialect)}
    ).all()
    # By id: one row per evaluation, in the order they were recorded.
    unique = {r[0]: tuple(r[1:]) for r in [*rows, first, last]}
    return [unique[i] for i in sorted(unique)]


LOSS_FIELDS = ("learner", "region", "incarnation", "step", "at", "loss", "tokens_per_s", "mfu")


def loss_samples(
    session: Session, run_id: str, *, per_learner: int = LOSS_POINTS_PER_LEARNER, budget: int = LOSS_POINTS_BUDGET
) -> list[tuple]:
    """Per-learner training loss, tokens/s and MFU (``LOSS_FIELDS``) sampled on a time grid: for every learner and grid
    time, the newest heartbeat at or before it — one backwards index seek each, never a scan of the heartbeats. Each
    learner contributes at most ``per_learner`` points (fewer when many share ``budget``)."""
    n_learners, first, last = session.connection().execute(
        select(func.count(), func.min(Learner.started_at), func.max(Learner.last_heartbeat_at)).where(Learner.run_id == run_id)
    ).one()
    if not n_learners or first is None or last is None:
        return []
    points = max(10, min(per_learner, budget // int(n_learners), MAX_GRID_POINTS))
    dialect = session.get_bind().dialect.name
    params = {"run": run_id, **_grid_times(first, last, points, dialect)}
    return [tuple(r) for r in session.connection().execute(_losses_on_grid(points, dialect), params)]


# --- events and rejections ----------------------------------------------------------------------------


def newest_events(session: Session, run_id: str, limit: int = EVENTS_SHOWN) -> list[tuple]:
    """The newest ``limit`` events (at, kind, actor, detail), newest first."""
    return [tuple(r) for r in session.connection().execute(
        select(Event.at, Event.kind, Event.actor, Event.detail)
        .where(Event.run_id == run_id)
        .order_by(Event.at.desc(), Event.id.desc())
        .limit(limit)
    )]


def run_end_detail(session: Session, run_id: str, status: str) -> str | None:
    """What the event that ended the run as ``status`` says (``run_failed``: the error), or None."""
    return session.connection().execute(
        select(Event.detail).where(Event.run_id == run_id, Event.kind == f"run_{status}").order_by(Event.at.desc()).limit(1)
    ).scalar()


def newest_rejections(session: Session, run_id: str, limit: int = REJECTIONS_SHOWN) -> list[tuple]:
    """The newest rejected submissions (decided_at, learner, fragment, base_version, id, reason), newest first."""
    return [tuple(r) for r in session.connection().execute(
        select(Submission.decided_at, Submission.learner_id, Submission.fragment, Submission.base_version, Submission.id,
               Submission.reject_reason)
        .where(Submission.run_id == run_id, REJECTED_ROWS)
        .order_by(Submission.decided_at.desc(), Submission.id.desc())
        .limit(limit)
    )]
