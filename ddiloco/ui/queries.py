"""The dashboard's data as frames and snapshots, from the ledger's report reads (``platform.ledger.reports`` and
``platform.ledger.dashboard``, which say what each read costs): no Streamlit here, and no SQL but the engine's.

Functions of a Session returning pandas DataFrames or frozen dataclasses; the health verdicts come from ``ui.health``.
Nothing here writes; the dashboard's engine is read-only as well (:func:`read_only_engine`). Works on SQLite and
PostgreSQL."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pandas as pd
from sqlalchemy import Engine, inspect
from sqlalchemy.engine import make_url
from sqlalchemy.exc import NoSuchModuleError
from sqlalchemy.orm import Session

from ddiloco.platform import liveness
from ddiloco.platform.config import ConfigError
from ddiloco.platform.ledger import dashboard as dash_q
from ddiloco.platform.ledger import reports as reports_q
from ddiloco.platform.ledger import runs as runs_q
from ddiloco.platform.ledger import synchronizer as sync_q
from ddiloco.platform.ledger.engine import make_engine
from ddiloco.platform.ledger.models import Run
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


def run_info(session: Session, run_id: str) -> RunInfo | None:
    run = runs_q.get_run(session, run_id)
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
    regions: dict[str, liveness.Verdict]
    """Each region's verdict (``liveness.region_verdicts``): up, down, or cut off."""


def health_snapshot(session: Session, run_id: str, now: datetime) -> RunHealthSnapshot | None:
    info = run_info(session, run_id)
    if info is None:
        return None
    as_of = info.as_of(now)
    policy = info.policy
    snaps = runs_q.read_learner_snapshots(session, run_id)
    verdicts = liveness.learner_verdicts(snaps, as_of, policy)
    regions = liveness.region_verdicts(snaps, as_of, policy)
    sync = h.synchronizer_verdict(
        lease_snapshots(session, run_id), reports_q.last_version_at(session, run_id), as_of, run_running=info.running,
        shards=runs_q.recorded_shards(info.config),
    )
    failed_why = dash_q.run_end_detail(session, run_id, info.status) if info.status == runs_q.FAILED else None
    health = h.run_health(info.status, verdicts, sync, policy, regions, failed_why=failed_why)
    return RunHealthSnapshot(info, as_of, verdicts, sync, health, regions)


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
    for run_id in dash_q.run_ids(session):
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


# --- learners and regions ---------------------------------------------------------------------------

LEARNER_COLUMNS = [
    "learner",
    "region",
    "status",
    "reason",
    "step",
    "tokens_per_s",
    "step_time_s",
    "model_flops_per_s",
    "mfu",
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


def learners_frame(session: Session, run_id: str, now: datetime, learners: list[Any] | None = None) -> pd.DataFrame:
    """A row per learner with its heartbeat-derived status (judged at ``now``) and submission fates
    (``ledger.dashboard.learner_rows``, read here unless given, and ``learner_fates``)."""
    info = run_info(session, run_id)
    if info is None:
        return pd.DataFrame(columns=LEARNER_COLUMNS)
    as_of = info.as_of(now)
    learners = dash_q.learner_rows(session, run_id) if learners is None else learners
    fates = dash_q.learner_fates(session, run_id, learners)
    snaps = [
        liveness.LearnerSnapshot(row.id, row.last_heartbeat_at, row.started_at, int(row.step), float(row.step_time_s or 0.0), row.status,
                                 row.region)
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
                "model_flops_per_s": float(row.model_flops_per_s) if row.model_flops_per_s is not None else math.nan,
                "mfu": float(row.mfu) if row.mfu is not None else math.nan,
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
    "status",
    "reason",
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


def regions_frame(learners: pd.DataFrame, verdicts: dict[str, liveness.Verdict] | None = None) -> pd.DataFrame:
    """What each region contributes, from :func:`learners_frame` (live throughput counts live learners only), with its
    verdict from ``verdicts`` (``liveness.region_verdicts``: up, down or cut off; blank when not given)."""
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
                "status": verdicts[region].status if verdicts and region in verdicts else None,
                "reason": verdicts[region].reason if verdicts and region in verdicts else None,
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


# --- synchronizer, versions, merges, curves, events --------------------------------------------------------

HOLDER_COLUMNS = ["shard", "holder", "token", "versions", "first_publish", "last_publish"]


def synchronizer_holders(session: Session, run_id: str, tokens: int = dash_q.HOLDER_TOKENS) -> pd.DataFrame:
    """``ledger.dashboard.synchronizer_holders``: per shard, what its newest fencing tokens published."""
    return pd.DataFrame(dash_q.synchronizer_holders(session, run_id, tokens), columns=HOLDER_COLUMNS)


def versions_frame(session: Session, run_id: str, max_points: int = dash_q.VERSION_POINTS) -> pd.DataFrame:
    """(fragment, version, at) for the version timeline, thinned to about ``max_points`` (``ledger.dashboard.version_timeline``)."""
    return pd.DataFrame(dash_q.version_timeline(session, run_id, max_points), columns=["fragment", "version", "at"])


def merges_frame(session: Session, run_id: str, limit: int = dash_q.MERGES_SHOWN) -> pd.DataFrame:
    """The newest ``limit`` merges, oldest first: quorum, grace window and wait, what was included."""
    df = pd.DataFrame(dash_q.newest_merges(session, run_id, limit), columns=list(dash_q.MERGE_FIELDS))
    # A negative window means "unbounded" (wait for every live learner).
    if not df.empty:
        df["grace_window_s"] = df["grace_window_s"].where(df["grace_window_s"] >= 0)
    return df


def staleness_frame(session: Session, run_id: str, versions: int = dash_q.STALENESS_VERSIONS) -> pd.DataFrame:
    """How many versions behind merged submissions were, over each fragment's newest ``versions`` versions."""
    return pd.DataFrame(dash_q.staleness_counts(session, run_id, versions), columns=["staleness", "submissions"])


def evaluations_frame(session: Session, run_id: str, points: int = dash_q.EVALUATION_POINTS) -> pd.DataFrame:
    """Validation loss over the run, sampled on a time grid of ``points`` (``ledger.dashboard.evaluation_samples``)."""
    return pd.DataFrame(dash_q.evaluation_samples(session, run_id, points), columns=list(dash_q.EVALUATION_FIELDS))


def training_loss_frame(
    session: Session, run_id: str, *, per_learner: int = dash_q.LOSS_POINTS_PER_LEARNER, budget: int = dash_q.LOSS_POINTS_BUDGET
) -> pd.DataFrame:
    """Per-learner training loss, tokens/s and MFU sampled on a time grid (``ledger.dashboard.loss_samples``), by learner
    and time.

    Learners report an exponential moving average of their loss, so a sample is already smooth."""
    rows = dash_q.loss_samples(session, run_id, per_learner=per_learner, budget=budget)
    return pd.DataFrame(rows, columns=list(dash_q.LOSS_FIELDS)).sort_values(["learner", "at"], ignore_index=True)


def events_frame(session: Session, run_id: str, limit: int = dash_q.EVENTS_SHOWN) -> pd.DataFrame:
    """The newest ``limit`` events, newest first, each with its category (failure, restart, chaos …)."""
    df = pd.DataFrame(dash_q.newest_events(session, run_id, limit), columns=["at", "kind", "actor", "detail"])
    df.insert(1, "category", [h.event_category(k) for k in df["kind"]])
    return df


def rejections_frame(session: Session, run_id: str, limit: int = dash_q.REJECTIONS_SHOWN) -> pd.DataFrame:
    """The newest rejected submissions with their reasons."""
    return pd.DataFrame(dash_q.newest_rejections(session, run_id, limit),
                        columns=["decided_at", "learner", "fragment", "base_version", "submission", "reason"])


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
    learners = learners_frame(session, run_id, now, dash_q.learner_rows(session, run_id))
    evaluations = evaluations_frame(session, run_id)
    summary = summarize(reports_q.run_aggregates(session, run_id), now)
    return RunPage(
        now=now,
        snapshot=snapshot,
        summary=summary,
        learners=learners,
        regions=regions_frame(learners, snapshot.regions),
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
