"""Every read the dashboard makes, as plain functions of a Session: no Streamlit here.

They return pandas DataFrames or frozen dataclasses, and cost the same at any length of history:
nothing here scans the heartbeats, versions or submissions. Totals come from the running totals the
ledger keeps (fragment heads, learner rows), pending and rejected work is summed over just those rows,
the training-loss and validation curves are sampled on a time grid by index seeks, the version
timeline by primary-key seeks, and lists (merges, events, rejections) are the newest few by index.
Statements of plain columns run on the session's connection: the ORM's per-execution work would cost
more than the reads. Nothing here writes; the dashboard's engine is read-only as well
(:func:`read_only_engine`). Works on SQLite and PostgreSQL."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pandas as pd
from sqlalchemy import DateTime, Engine, bindparam, func, inspect, select, true, union_all
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import make_url
from sqlalchemy.exc import NoSuchModuleError
from sqlalchemy.orm import Session

from ddiloco.platform import liveness
from ddiloco.platform.config import ConfigError
from ddiloco.platform.fragments import shard_fragments
from ddiloco.platform.ledger import reports as reports_q
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger import synchronizer as sync_q
from ddiloco.platform.ledger.engine import make_engine
from ddiloco.platform.ledger.models import (
    MERGED,
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
from ddiloco.platform.redact import redact_url
from ddiloco.platform.summary import RunSummary, run_summary, summarize
from ddiloco.ui import health as h

REQUIRED_TABLES = (
    "runs",
    "learners",
    "heartbeats",
    "submissions",
    "fragment_versions",
    "merges",
    "events",
    "evaluations",
    "synchronizer_leases",
)
LOSS_POINTS_BUDGET = 4_000
"""Training-loss points sent to the browser for all learners together (the chart stays responsive)."""
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


class LedgerUnavailable(RuntimeError):
    """The ledger cannot be read: no file, no server, no schema. The message says what to do."""


# --- the engine -----------------------------------------------------------------------------------------


def read_only_engine(url: str) -> Engine:
    """The platform's read-only engine (``make_engine(read_only=True)``) for a ledger that must already exist.

    A missing SQLite file is reported, not created; the schema is never migrated from here."""
    try:
        parsed = make_url(url)
    except Exception as err:  # noqa: BLE001 - any parse failure is a bad URL
        raise LedgerUnavailable(redact_url(f"not a ledger URL: {url} ({err})")) from None
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        database = parsed.database
        if database and database != ":memory:" and not database.startswith("file:") and not Path(database).exists():
            raise LedgerUnavailable(f"no ledger file at {database}: start a run first, or pass --ledger with the right path")
    elif backend != "postgresql":
        raise LedgerUnavailable(f"unsupported ledger backend {backend!r}: use sqlite:/// or postgresql+psycopg://")
    try:
        # One snapshot per page load, so the figures of one run agree with each other.
        return make_engine(url, read_only=True)
    except (NoSuchModuleError, ImportError, ConfigError) as err:
        raise LedgerUnavailable(redact_url(f"cannot open {url}: {err}")) from None


def check_schema(engine: Engine) -> None:
    """Raise LedgerUnavailable unless every table the dashboard reads exists."""
    try:
        with engine.connect() as conn:
            names = set(inspect(conn).get_table_names())
    except Exception as err:  # noqa: BLE001 - server down, bad credentials, corrupt file …
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise LedgerUnavailable(redact_url(f"cannot connect to the ledger at {engine.url}: {first}")) from None
    missing = [t for t in REQUIRED_TABLES if t not in names]
    if missing:
        what = "has no ledger schema yet" if len(missing) == len(REQUIRED_TABLES) else f"lacks tables {', '.join(missing)}"
        raise LedgerUnavailable(
            f"the ledger at {redact_url(str(engine.url))} {what}. The dashboard never migrates: run "
            f"`ddiloco ledger upgrade --ledger URL` (or start a run), then reload."
        )


# --- runs -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunInfo:
    id: str
    status: str
    created_at: datetime
    finished_at: datetime | None
    num_fragments: int
    token_budget: int
    code_version: str
    git_commit: str | None
    flow_run_url: str | None
    config: dict[str, Any]

    @property
    def policy(self) -> h.HealthPolicy:
        return h.HealthPolicy.from_config(self.config)

    @property
    def running(self) -> bool:
        return self.status == "running"

    def as_of(self, now: datetime) -> datetime:
        """The moment health is judged at: now while running, the end for a finished run (a post-mortem)."""
        return self.finished_at if self.finished_at is not None and not self.running else now


def _info(run: Run) -> RunInfo:
    return RunInfo(
        id=run.id,
        status=run.status,
        created_at=run.created_at,
        finished_at=run.finished_at,
        num_fragments=run.num_fragments,
        token_budget=run.token_budget,
        code_version=run.code_version,
        git_commit=run.git_commit,
        flow_run_url=run.flow_run_url,
        config=runs_q.recorded_config(run),
    )


def run_ids(session: Session) -> list[str]:
    """Every run, newest first."""
    return list(session.scalars(select(Run.id).order_by(Run.created_at.desc(), Run.id)))


def run_info(session: Session, run_id: str) -> RunInfo | None:
    run = session.get(Run, run_id)
    return _info(run) if run is not None else None


# --- health snapshots --------------------------------------------------------------------------------


def lease_snapshots(session: Session, run_id: str) -> list[h.LeaseSnapshot]:
    """Every shard's lease (one row per shard ever held: as many as the run has shards)."""
    return [h.LeaseSnapshot(lease.holder, int(lease.token), lease.acquired_at, lease.expires_at, lease.shard)
            for lease in sync_q.leases(session, run_id)]


@dataclass(frozen=True)
class RunHealthSnapshot:
    info: RunInfo
    as_of: datetime
    verdicts: dict[str, liveness.Verdict]
    sync: h.SyncVerdict
    health: h.RunHealth


def health_snapshot(session: Session, run_id: str, now: datetime) -> RunHealthSnapshot | None:
    info = run_info(session, run_id)
    if info is None:
        return None
    as_of = info.as_of(now)
    policy = info.policy
    verdicts = liveness.learner_verdicts(runs_q.read_learner_snapshots(session, run_id), as_of, policy)
    sync = h.synchronizer_verdict(
        lease_snapshots(session, run_id), reports_q.last_version_at(session, run_id), as_of, run_running=info.running,
        shards=runs_q.recorded_shards(info.config),
    )
    return RunHealthSnapshot(info, as_of, verdicts, sync, h.run_health(info.status, verdicts, sync, policy))


# --- runs overview ------------------------------------------------------------------------------------

OVERVIEW_COLUMNS = [
    "run",
    "health",
    "status",
    "age_s",
    "tokens",
    "token_budget",
    "versions",
    "goodput",
    "downtime_s",
    "val_loss",
    "learners_alive",
    "learners",
    "created_at",
    "reason",
]


def runs_overview(session: Session, now: datetime) -> pd.DataFrame:
    """One row per run (newest first): status, age, tokens, global versions, goodput, global downtime
    (longest gap between versions), current validation loss and a health verdict."""
    rows = []
    for run_id in run_ids(session):
        snap = health_snapshot(session, run_id, now)
        if snap is None:
            continue
        summary = run_summary(session, run_id, now)
        counts = h.count_statuses(snap.verdicts.values())
        rows.append(
            {
                "run": run_id,
                "health": snap.health.level,
                "status": snap.info.status,
                "age_s": (now - snap.info.created_at).total_seconds(),
                "tokens": summary.tokens,
                "token_budget": snap.info.token_budget,
                "versions": sum(summary.versions.values()),
                "goodput": summary.goodput,
                "downtime_s": summary.longest_version_gap_s,
                "val_loss": summary.val_loss_end,
                "learners_alive": counts[liveness.ALIVE] + counts[liveness.STRAGGLING] + counts[liveness.RECOVERING],
                "learners": len(snap.verdicts),
                "created_at": snap.info.created_at,
                "reason": "; ".join(snap.health.reasons),
            }
        )
    return pd.DataFrame(rows, columns=OVERVIEW_COLUMNS)


# --- submissions, aggregated once ------------------------------------------------------------------------

SUBMISSION_STATS_COLUMNS = ["learner", "status", "staleness", "submissions", "tokens", "bytes", "last_at"]


def submission_stats(session: Session, run_id: str) -> pd.DataFrame:
    """``ledger.queries.submission_groups`` as a frame: the learner table and the staleness histogram."""
    return stats_frame(reports_q.submission_groups(session, run_id))


def stats_frame(groups: list[reports_q.SubmissionGroup]) -> pd.DataFrame:
    return pd.DataFrame(groups, columns=SUBMISSION_STATS_COLUMNS)


def learner_rows(session: Session, run_id: str) -> list[Any]:
    """The run's learners, region by region, with the newest loss each reported, its submission totals and its link."""
    # Named columns, not the entity: only what the page shows is read.
    return list(
        session.connection().execute(
            select(
                Learner.id,
                Learner.region,
                Learner.status,
                Learner.incarnation,
                Learner.started_at,
                Learner.last_heartbeat_at,
                Learner.step,
                Learner.tokens_per_s,
                Learner.step_time_s,
                Learner.tokens_trained,
                Learner.tokens_lost,
                Learner.inc_tokens_trained,
                Learner.inc_tokens_submitted,
                Learner.busy_s,
                Learner.flow_run_url,
                Learner.loss,
                Learner.submissions,
                Learner.tokens_sent,
                Learner.last_submission_at,
                Learner.queue_depth,
                Learner.oldest_unsent_s,
                Learner.link_json,
            )
            .where(Learner.run_id == run_id)
            .order_by(Learner.region, Learner.id)
        )
    )


# --- learners and regions ---------------------------------------------------------------------------

LEARNER_COLUMNS = [
    "learner",
    "region",
    "status",
    "reason",
    "step",
    "tokens_per_s",
    "step_time_s",
    "last_heartbeat_at",
    "silent_s",
    "last_submission_at",
    "merged",
    "rejected",
    "pending",
    "tokens_trained",
    "tokens_merged",
    "tokens_lost",
    "loss",
    "incarnation",
    "flow_run_url",
    "queue_depth",
    "oldest_unsent_s",
    "cadence",
    "cadence_since",
    "cadence_reason",
    "up_mbit_s",
    "down_mbit_s",
]

LINK_JSON_MAX = 20_000
"""A learner's link report longer than this is not parsed (a learner writes it: it may be anything)."""
REASON_CHARS = 1_000


@dataclass(frozen=True)
class LinkView:
    """What the learners table shows of a learner's link report (``learners.link_json``); blank when absent or malformed."""

    cadence: str | None = None
    """"every 16 steps, int4", with "(adaptive)" when the learner chose it."""
    since: datetime | None = None
    reason: str | None = None
    up_mbit_s: float = math.nan
    """What its completed uploads moved while they ran."""
    down_mbit_s: float = math.nan


def link_view(raw: object) -> LinkView:
    """Read a learner's link report defensively: every field is checked for its type and range."""
    if not isinstance(raw, str) or len(raw) > LINK_JSON_MAX:
        return LinkView()
    try:
        d = json.loads(raw)
    except ValueError:
        return LinkView()
    if not isinstance(d, dict):
        return LinkView()

    def number(key: str) -> float | None:
        x = d.get(key)
        ok = isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
        return float(x) if ok else None

    every, codec = d.get("every"), d.get("codec")
    cadence = None
    if isinstance(every, int) and not isinstance(every, bool) and 0 < every < 1 << 31 and isinstance(codec, str):
        cadence = f"every {every} steps, {codec[:16]}" + (" (adaptive)" if d.get("adaptive") is True else "")
    reason = d.get("reason")
    since = number("since")
    up, down = number("up_bps"), number("down_bps")
    return LinkView(
        cadence=cadence,
        since=datetime.fromtimestamp(since, UTC) if since is not None and since < 1e11 else None,
        reason=" ".join(reason.split())[:REASON_CHARS] if isinstance(reason, str) else None,
        up_mbit_s=up * 8 / 1e6 if up is not None else math.nan,
        down_mbit_s=down * 8 / 1e6 if down is not None else math.nan,
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
    for total in reports_q.rejected_totals(session, run_id):
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


def learners_frame(session: Session, run_id: str, now: datetime, learners: list[Any] | None = None) -> pd.DataFrame:
    """A row per learner with its heartbeat-derived status (judged at ``now``) and submission fates
    (from :func:`learner_rows`, read here unless given, and :func:`learner_fates`)."""
    info = run_info(session, run_id)
    if info is None:
        return pd.DataFrame(columns=LEARNER_COLUMNS)
    as_of = info.as_of(now)
    learners = learner_rows(session, run_id) if learners is None else learners
    fates = learner_fates(session, run_id, learners)
    snaps = [
        liveness.LearnerSnapshot(row.id, row.last_heartbeat_at, row.started_at, int(row.step), float(row.step_time_s or 0.0), row.status)
        for row in learners
    ]
    verdicts = liveness.learner_verdicts(snaps, as_of, info.policy)
    rows = []
    for row, snap in zip(learners, snaps):
        loss = row.loss
        fate = fates[row.id]
        link = link_view(row.link_json)
        unsubmitted_dead = max(0, row.inc_tokens_trained - row.inc_tokens_submitted) if verdicts[row.id].status == liveness.DEAD else 0
        rows.append(
            {
                "learner": row.id,
                "region": row.region,
                "status": verdicts[row.id].status,
                "reason": verdicts[row.id].reason,
                "step": int(row.step),
                "tokens_per_s": float(row.tokens_per_s or 0.0),
                "step_time_s": float(row.step_time_s or 0.0),
                "last_heartbeat_at": row.last_heartbeat_at,
                "silent_s": liveness.silent_s(snap, as_of),
                "last_submission_at": row.last_submission_at,
                "merged": fate.merged,
                "rejected": fate.rejected,
                "pending": fate.pending,
                "tokens_trained": int(row.tokens_trained + row.inc_tokens_trained),
                "tokens_merged": fate.tokens_merged,
                "tokens_lost": int(row.tokens_lost + unsubmitted_dead),
                "loss": float(loss) if loss is not None else math.nan,
                "incarnation": int(row.incarnation),
                "flow_run_url": row.flow_run_url,
                "queue_depth": int(row.queue_depth) if row.queue_depth is not None else None,
                "oldest_unsent_s": float(row.oldest_unsent_s) if row.oldest_unsent_s is not None else math.nan,
                "cadence": link.cadence,
                "cadence_since": link.since,
                "cadence_reason": link.reason,
                "up_mbit_s": link.up_mbit_s,
                "down_mbit_s": link.down_mbit_s,
            }
        )
    return pd.DataFrame(rows, columns=LEARNER_COLUMNS)


REGION_COLUMNS = [
    "region",
    "learners",
    "alive",
    "straggling",
    "recovering",
    "dead",
    "tokens_per_s",
    "tokens_trained",
    "tokens_merged",
    "share_merged",
]


def regions_frame(learners: pd.DataFrame) -> pd.DataFrame:
    """What each region contributes, from :func:`learners_frame` (live throughput counts live learners only)."""
    if learners.empty:
        return pd.DataFrame(columns=REGION_COLUMNS)
    rows = []
    total_merged = max(1, int(learners["tokens_merged"].sum()))
    for region, grp in learners.groupby("region", sort=True):
        counts = grp["status"].value_counts()
        live = grp[grp["status"] != liveness.DEAD]
        rows.append(
            {
                "region": region,
                "learners": len(grp),
                "alive": int(counts.get(liveness.ALIVE, 0)),
                "straggling": int(counts.get(liveness.STRAGGLING, 0)),
                "recovering": int(counts.get(liveness.RECOVERING, 0)),
                "dead": int(counts.get(liveness.DEAD, 0)),
                "tokens_per_s": float(live["tokens_per_s"].sum()),
                "tokens_trained": int(grp["tokens_trained"].sum()),
                "tokens_merged": int(grp["tokens_merged"].sum()),
                "share_merged": float(grp["tokens_merged"].sum()) / total_merged,
            }
        )
    return pd.DataFrame(rows, columns=REGION_COLUMNS)


# --- synchronizer ---------------------------------------------------------------------------------------


def synchronizer_holders(session: Session, run_id: str, tokens: int = HOLDER_TOKENS) -> pd.DataFrame:
    """The synchronizers that published for this run (per shard, its newest ``tokens`` fencing tokens): shard,
    holder, token, versions, first and last publish. Per token and fragment the versions are one contiguous
    range (tokens never go back), so a few index seeks per fragment find it — never a count over the versions."""
    columns = ["shard", "holder", "token", "versions", "first_publish", "last_publish"]
    newest = dict(session.execute(select(SynchronizerLease.shard, SynchronizerLease.token).where(SynchronizerLease.run_id == run_id)).all())
    if not newest:
        return pd.DataFrame(columns=columns)
    shard_of = _fragment_shards(session, run_id)
    rows = []
    for shard, top in sorted(newest.items()):
        for token in range(int(top), max(0, int(top) - tokens), -1):
            ranges = [r for r in session.connection().execute(_token_ranges(run_id, token)).all()
                      if r[0] is not None and shard_of.get(r[5], 0) == shard]
            if ranges:
                rows.append({
                    "shard": shard,
                    "holder": ranges[0][4],
                    "token": token,
                    "versions": sum(r[1] - r[0] + 1 for r in ranges),
                    "first_publish": min(r[2] for r in ranges),
                    "last_publish": max(r[3] for r in ranges),
                })
    return pd.DataFrame(sorted(rows, key=lambda r: (r["shard"], r["token"])), columns=columns)


def _fragment_shards(session: Session, run_id: str) -> dict[int, int]:
    """Each fragment's synchronizer shard, from the run's recorded config and fragment sizes ({} for one shard)."""
    info = run_info(session, run_id)
    shards = runs_q.recorded_shards(info.config) if info is not None else 1
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


# --- versions and merges ---------------------------------------------------------------------------------


_VERSIONS_BY_KEY = (
    select(FragmentVersion.fragment, FragmentVersion.version, FragmentVersion.created_at)
    .where(
        FragmentVersion.run_id == bindparam("run"),
        FragmentVersion.fragment.in_(bindparam("fragments", expanding=True)),
        FragmentVersion.version.in_(bindparam("versions", expanding=True)),
    )
)


def versions_frame(session: Session, run_id: str, max_points: int = VERSION_POINTS) -> pd.DataFrame:
    """(fragment, version, at) for the version timeline; thinned to every k-th version when there are
    more than ``max_points`` (the newest version of each fragment, from its head, is always kept): one
    statement of primary-key seeks (fragments x sampled versions), never a scan."""
    heads = session.connection().execute(
        select(FragmentHead.fragment, FragmentHead.version, FragmentHead.created_at).where(FragmentHead.run_id == run_id)
    ).all()
    columns = ["fragment", "version", "at"]
    if not heads:
        return pd.DataFrame(columns=columns)
    total = sum(h.version + 1 for h in heads)
    k = max(1, math.ceil(total / max_points))
    rows = {(h.fragment, h.version): tuple(h) for h in heads}
    wanted = list(range(0, max(h.version for h in heads) + 1, k))
    for start in range(0, len(wanted), 500):
        params = {"run": run_id, "fragments": [h.fragment for h in heads], "versions": wanted[start:start + 500]}
        rows.update({(r.fragment, r.version): tuple(r) for r in session.connection().execute(_VERSIONS_BY_KEY, params)})
    return pd.DataFrame([rows[key] for key in sorted(rows)], columns=columns)


MERGE_COLUMNS = [
    "at",
    "fragment",
    "version",
    "quorum",
    "live_learners",
    "included",
    "rejected",
    "grace_window_s",
    "grace_waited_s",
    "merge_s",
    "reason",
]


def merges_frame(session: Session, run_id: str, limit: int = MERGES_SHOWN) -> pd.DataFrame:
    """The newest ``limit`` merges, oldest first: quorum, grace window and wait, what was included."""
    rows = session.connection().execute(
        select(
            Merge.at,
            Merge.fragment,
            Merge.version,
            Merge.quorum,
            Merge.live_learners,
            Merge.included,
            Merge.rejected,
            Merge.grace_window_s,
            Merge.grace_waited_s,
            Merge.merge_s,
            Merge.reason,
        )
        .where(Merge.run_id == run_id)
        .order_by(Merge.at.desc(), Merge.id.desc())
        .limit(limit)
    ).all()
    df = pd.DataFrame([tuple(r) for r in reversed(rows)], columns=MERGE_COLUMNS)
    # A negative window means "unbounded" (wait for every live learner).
    if not df.empty:
        df["grace_window_s"] = df["grace_window_s"].where(df["grace_window_s"] >= 0)
    return df


def staleness_frame(session: Session, run_id: str, versions: int = STALENESS_VERSIONS) -> pd.DataFrame:
    """How many versions behind merged submissions were (their base vs the version they joined), over each
    fragment's newest ``versions`` versions: an index range per fragment, whatever the history."""
    oldest_head = session.connection().execute(select(func.min(FragmentHead.version)).where(FragmentHead.run_id == run_id)).scalar()
    if oldest_head is None:
        return pd.DataFrame(columns=["staleness", "submissions"])
    rows = session.connection().execute(
        select(Submission.staleness, func.count())
        .select_from(FragmentHead)
        .join(
            Submission,
            (Submission.run_id == FragmentHead.run_id)
            & (Submission.fragment == FragmentHead.fragment)
            & (Submission.merged_version > FragmentHead.version - versions)
            # The same range as a constant too: the planner cannot estimate the correlated bound, took a third of
            # the fragment's history per seek, and past ~4M submissions the cost estimate crossed PostgreSQL's
            # JIT threshold, compiling the statement at every refresh (~12-20 ms, #15).
            & (Submission.merged_version > oldest_head - versions),
        )
        .where(FragmentHead.run_id == run_id, Submission.status == MERGED, Submission.staleness.is_not(None))
        .group_by(Submission.staleness)
        .order_by(Submission.staleness)
    ).all()
    return pd.DataFrame([(int(st), int(n)) for st, n in rows], columns=["staleness", "submissions"])


# --- losses --------------------------------------------------------------------------------------------


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
            select(Heartbeat.incarnation, Heartbeat.step, Heartbeat.at, Heartbeat.loss)
            .where(Heartbeat.run_id == bindparam("run"), Heartbeat.learner_id == Learner.id, Heartbeat.at <= _PG_GRID.c.t)
            .order_by(Heartbeat.at.desc())
            .limit(1)
            .lateral("pick")
        )
        return (
            select(Learner.id.label("learner"), Learner.region, pick.c.incarnation, pick.c.step, pick.c.at, pick.c.loss)
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
        select(picks.c.learner, picks.c.region, Heartbeat.incarnation, Heartbeat.step, Heartbeat.at, Heartbeat.loss)
        .join(Heartbeat, Heartbeat.id == picks.c.hb)
        .where(Heartbeat.loss.is_not(None))
        .distinct()
    )


_EVALUATION_COLUMNS = (Evaluation.at, Evaluation.tokens, Evaluation.versions_total, Evaluation.val_loss, Evaluation.val_accuracy)


def evaluations_frame(session: Session, run_id: str, points: int = EVALUATION_POINTS) -> pd.DataFrame:
    """Validation loss over the run: the newest evaluation at or before each time of a grid (index seeks),
    plus the first and the last, so a long run's curve costs ``points`` rows, not one per evaluation."""
    columns = ["at", "tokens", "versions_total", "val_loss", "val_accuracy"]
    cols = _EVALUATION_COLUMNS
    points = max(2, min(points, MAX_GRID_POINTS))
    base = select(Evaluation.id, *cols).where(Evaluation.run_id == run_id)
    few = session.connection().execute(base.order_by(Evaluation.at, Evaluation.id).limit(points + 1)).all()
    if len(few) <= points:  # every evaluation fits: all of them
        return pd.DataFrame([tuple(r[1:]) for r in few], columns=columns)
    first = few[0]
    last = session.connection().execute(base.order_by(Evaluation.at.desc(), Evaluation.id.desc()).limit(1)).one()
    dialect = session.get_bind().dialect.name
    rows = session.connection().execute(
        _evaluations_on_grid(points, dialect), {"run": run_id, **_grid_times(first.at, last.at, points, dialect)}
    ).all()
    # By id: one row per evaluation, in the order they were recorded.
    unique = {r[0]: tuple(r[1:]) for r in [*rows, first, last]}
    return pd.DataFrame([unique[i] for i in sorted(unique)], columns=columns)


def training_loss_frame(
    session: Session, run_id: str, *, per_learner: int = LOSS_POINTS_PER_LEARNER, budget: int = LOSS_POINTS_BUDGET
) -> pd.DataFrame:
    """Per-learner training loss sampled on a time grid: for every learner and grid time, the newest
    heartbeat at or before it — one backwards index seek each, never a scan of the heartbeats.

    Learners report an exponential moving average of their loss, so a sample is already smooth.
    Each learner contributes at most ``per_learner`` points (fewer when many share ``budget``)."""
    columns = ["learner", "region", "incarnation", "step", "at", "loss"]
    n_learners, first, last = session.connection().execute(
        select(func.count(), func.min(Learner.started_at), func.max(Learner.last_heartbeat_at)).where(Learner.run_id == run_id)
    ).one()
    if not n_learners or first is None or last is None:
        return pd.DataFrame(columns=columns)
    points = max(10, min(per_learner, budget // int(n_learners), MAX_GRID_POINTS))
    dialect = session.get_bind().dialect.name
    params = {"run": run_id, **_grid_times(first, last, points, dialect)}
    rows = session.connection().execute(_losses_on_grid(points, dialect), params).all()
    df = pd.DataFrame([tuple(r) for r in rows], columns=columns)
    return df.sort_values(["learner", "at"], ignore_index=True)


# --- events and rejections ----------------------------------------------------------------------------


def events_frame(session: Session, run_id: str, limit: int = EVENTS_SHOWN) -> pd.DataFrame:
    """The newest ``limit`` events, newest first, each with its category (failure, restart, chaos …)."""
    rows = session.connection().execute(
        select(Event.at, Event.kind, Event.actor, Event.detail)
        .where(Event.run_id == run_id)
        .order_by(Event.at.desc(), Event.id.desc())
        .limit(limit)
    ).all()
    df = pd.DataFrame([tuple(r) for r in rows], columns=["at", "kind", "actor", "detail"])
    df.insert(1, "category", [h.event_category(k) for k in df["kind"]])
    return df


def rejections_frame(session: Session, run_id: str, limit: int = 200) -> pd.DataFrame:
    """The newest rejected submissions with their reasons."""
    rows = session.connection().execute(
        select(
            Submission.decided_at,
            Submission.learner_id,
            Submission.fragment,
            Submission.base_version,
            Submission.id,
            Submission.reject_reason,
        )
        .where(Submission.run_id == run_id, REJECTED_ROWS)
        .order_by(Submission.decided_at.desc(), Submission.id.desc())
        .limit(limit)
    ).all()
    return pd.DataFrame(
        [tuple(r) for r in rows], columns=["decided_at", "learner", "fragment", "base_version", "submission", "reason"]
    )


def rejection_reasons(summary: RunSummary) -> pd.DataFrame:
    """Rejected submissions counted by the class of their reason ('stale', 'norm outlier', …), most first."""
    counts = summary.rejected_by_reason
    return pd.DataFrame(
        sorted(({"reason": r, "submissions": n} for r, n in counts.items()), key=lambda d: (-d["submissions"], d["reason"])),
        columns=["reason", "submissions"],
    )


# --- everything the run health page shows, read in one transaction -------------------------------------


@dataclass(frozen=True)
class RunPage:
    """One consistent snapshot of a run (a single read transaction) for the run health page."""

    now: datetime
    snapshot: RunHealthSnapshot
    summary: RunSummary
    learners: pd.DataFrame
    regions: pd.DataFrame
    holders: pd.DataFrame
    last_merge_at: datetime | None
    versions: pd.DataFrame
    merges: pd.DataFrame
    staleness: pd.DataFrame
    evaluations: pd.DataFrame
    training_loss: pd.DataFrame
    events: pd.DataFrame
    rejections: pd.DataFrame
    rejection_reasons: pd.DataFrame


def run_page(session: Session, run_id: str, now: datetime) -> RunPage | None:
    snapshot = health_snapshot(session, run_id, now)
    if snapshot is None:
        return None
    learners = learners_frame(session, run_id, now, learner_rows(session, run_id))
    evaluations = evaluations_frame(session, run_id)
    summary = summarize(reports_q.run_aggregates(session, run_id), now)
    return RunPage(
        now=now,
        snapshot=snapshot,
        summary=summary,
        learners=learners,
        regions=regions_frame(learners),
        holders=synchronizer_holders(session, run_id),
        last_merge_at=reports_q.last_merge_at(session, run_id),
        versions=versions_frame(session, run_id),
        merges=merges_frame(session, run_id),
        staleness=staleness_frame(session, run_id),
        evaluations=evaluations,
        training_loss=training_loss_frame(session, run_id),
        events=events_frame(session, run_id),
        rejections=rejections_frame(session, run_id),
        rejection_reasons=rejection_reasons(summary),
    )
