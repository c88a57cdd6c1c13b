"""SQLAlchemy 2.0 models of the ledger. The schema itself is owned by the Alembic migrations."""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}



class UtcDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite would otherwise return naive ones)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: object) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("the ledger stores timezone-aware datetimes only")
        return value.astimezone(timezone.utc)

    def process_result_value(self, value: datetime | None, dialect: object) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


# Submission fates.
PENDING = "pending"
MERGED = "merged"
REJECTED = "rejected"

# Predicates of the partial indexes; the queries that use an index say exactly the same.
GC_SUBMISSIONS = text("status <> 'pending' AND blob_deleted = false")
REJECTED_ROWS = text("status = 'rejected'")
GC_VERSIONS = text("gc_done = false")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())
    status: Mapped[str] = mapped_column(String(16), default="running")
    config_json: Mapped[str] = mapped_column(Text)
    code_version: Mapped[str] = mapped_column(String(64))
    git_commit: Mapped[str | None] = mapped_column(String(64), nullable=True)
    num_fragments: Mapped[int] = mapped_column(Integer)
    token_budget: Mapped[int] = mapped_column(BigInteger)
    flow_run_url: Mapped[str | None] = mapped_column(Text, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)
    # Running totals of rejected work, kept by every rejection's own transaction.
    tokens_rejected: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    submissions_rejected: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")


class FragmentSpec(Base):
    """Which tensors make up fragment p, with their shapes, fixed when the run starts."""

    __tablename__ = "fragment_specs"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    fragment: Mapped[int] = mapped_column(Integer, primary_key=True)
    tensors_json: Mapped[str] = mapped_column(Text)
    numel: Mapped[int] = mapped_column(BigInteger)
    nbytes: Mapped[int] = mapped_column(BigInteger)


class Learner(Base):
    __tablename__ = "learners"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    region: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), default="alive")
    incarnation: Mapped[int] = mapped_column(Integer, default=0)
    started_at: Mapped[datetime] = mapped_column(UtcDateTime())
    last_heartbeat_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)
    step: Mapped[int] = mapped_column(BigInteger, default=0)
    tokens_per_s: Mapped[float] = mapped_column(Float, default=0.0)
    step_time_s: Mapped[float] = mapped_column(Float, default=0.0)
    # Token accounting summed over every incarnation (see ledger.reports.token_accounting).
    tokens_trained: Mapped[int] = mapped_column(BigInteger, default=0)
    tokens_submitted: Mapped[int] = mapped_column(BigInteger, default=0)
    tokens_lost: Mapped[int] = mapped_column(BigInteger, default=0)
    # The current incarnation's counts, folded into the totals when it ends.
    inc_tokens_trained: Mapped[int] = mapped_column(BigInteger, default=0)
    inc_tokens_submitted: Mapped[int] = mapped_column(BigInteger, default=0)
    busy_s: Mapped[float] = mapped_column(Float, default=0.0)
    """Seconds of training reported by all incarnations (for goodput)."""
    optimizer_state_key: Mapped[str | None] = mapped_column(Text, nullable=True)
    optimizer_state_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    flow_run_url: Mapped[str | None] = mapped_column(Text, nullable=True)
    host: Mapped[str | None] = mapped_column(String(255), nullable=True)
    """Where the current incarnation runs (with pid): lets a supervisor or chaos tool signal it."""
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    data_batches: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    """Micro-batches each rank had drawn when the newest registered submission was sent: where a
    restarted learner resumes its data stream (set by the current incarnation's registrations)."""
    # Running totals of every submission the learner registered (all incarnations, whatever their fate),
    # kept by the registration's own statement so the dashboard never aggregates the submissions.
    submissions: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    tokens_sent: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    bytes_sent: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    last_submission_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    """The newest training loss the learner reported."""
    # The learner's upload link, as its newest exchange reported it (None before it reported any).
    queue_depth: Mapped[int | None] = mapped_column(Integer, nullable=True)
    """Fragments with an unsent increment waiting in the upload queue."""
    oldest_unsent_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    """Age of the oldest unsent increment, seconds."""
    link_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    """The link's measured rates and the send period and codec chosen from them, with the reason (JSON)."""
    model_flops_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    """One device's model FLOP/s (forward and backward) at the newest beat; None where the model was not counted."""
    mfu: Mapped[float | None] = mapped_column(Float, nullable=True)
    """That against the device's published peak; None where no peak is known (a CPU, an unlisted GPU)."""
    world_size: Mapped[int | None] = mapped_column(Integer, nullable=True)
    """Ranks of the current incarnation's job, recorded when it registered (at most ``learners.max_world_size``): the
    synchronizer judges its tokens per step by these ranks' batches. None: registered before the ledger recorded it."""


class Heartbeat(Base):
    __tablename__ = "heartbeats"
    __table_args__ = (
        ForeignKeyConstraint(["run_id", "learner_id"], ["learners.run_id", "learners.id"]),
        Index("ix_heartbeats_run_learner_at", "run_id", "learner_id", "at"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(64))
    learner_id: Mapped[str] = mapped_column(String(64))
    incarnation: Mapped[int] = mapped_column(Integer)
    at: Mapped[datetime] = mapped_column(UtcDateTime())
    step: Mapped[int] = mapped_column(BigInteger)
    tokens: Mapped[int] = mapped_column(BigInteger)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    tokens_per_s: Mapped[float] = mapped_column(Float)
    step_time_s: Mapped[float] = mapped_column(Float)
    # The learner's upload link, at this beat.
    queue_depth: Mapped[int | None] = mapped_column(Integer, nullable=True)
    """Fragments with an unsent increment waiting in the upload queue."""
    oldest_unsent_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    """Age of the oldest unsent increment, seconds."""
    link_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    """The link's measured rates and the send period and codec chosen from them, with the reason (JSON)."""
    model_flops_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    """One device's model FLOP/s at this beat (see :attr:`Learner.model_flops_per_s`)."""
    mfu: Mapped[float | None] = mapped_column(Float, nullable=True)
    """That against the device's published peak, at this beat."""


class Submission(Base):
    __tablename__ = "submissions"
    __table_args__ = (
        UniqueConstraint("run_id", "learner_id", "uid", name="uq_submissions_run_learner_uid"),
        Index("ix_submissions_poll", "run_id", "status", "fragment"),
        Index("ix_submissions_fragment_version", "run_id", "fragment", "merged_version"),
        # Partial indexes hold only the rows their query wants (decided blobs not yet collected; the
        # rejected), so GC and the dashboard seek them instead of reading every submission ever made.
        # Their predicates are literals: a bound parameter would not prove the index usable.
        Index("ix_submissions_gc", "run_id", "id", sqlite_where=GC_SUBMISSIONS, postgresql_where=GC_SUBMISSIONS),
        Index("ix_submissions_rejected", "run_id", "decided_at", sqlite_where=REJECTED_ROWS, postgresql_where=REJECTED_ROWS),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"))
    learner_id: Mapped[str] = mapped_column(String(64))
    uid: Mapped[str] = mapped_column(String(64))
    """Chosen by the learner before upload; registering the same uid twice is a no-op."""
    fragment: Mapped[int] = mapped_column(Integer)
    base_version: Mapped[int] = mapped_column(Integer)
    c_steps: Mapped[int] = mapped_column(Integer)
    c_tokens: Mapped[int] = mapped_column(BigInteger)
    tokens_new: Mapped[int] = mapped_column(BigInteger)
    """Tokens trained by the learner since its previous submission: the tokens whose fate this is."""
    blob_key: Mapped[str] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64))
    nbytes: Mapped[int] = mapped_column(BigInteger)
    codec: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())
    status: Mapped[str] = mapped_column(String(16), default=PENDING)
    merged_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    merge_id: Mapped[int | None] = mapped_column(ForeignKey("merges.id"), nullable=True)
    reject_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    decided_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)
    norm: Mapped[float | None] = mapped_column(Float, nullable=True)
    weight: Mapped[float | None] = mapped_column(Float, nullable=True)
    staleness: Mapped[int | None] = mapped_column(Integer, nullable=True)
    blob_deleted: Mapped[bool] = mapped_column(Boolean, default=False)


class RejectionTotal(Base):
    """Rejected submissions of one learner id for one class of reason, summed by every rejection's own transaction:
    the dashboard's per-learner fates and the summary's reasons read these few rows, never the rejected ones."""

    __tablename__ = "rejection_totals"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    learner_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    """As the submissions say: also an id no learner registered (an unknown learner's rejected work)."""
    reason: Mapped[str] = mapped_column(String(64), primary_key=True)
    """The reason's class (``ledger.rejections.reason_class``), not its text: the text carries figures, the class a few words."""
    submissions: Mapped[int] = mapped_column(BigInteger, default=0)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    nbytes: Mapped[int] = mapped_column(BigInteger, default=0)


class FragmentVersion(Base):
    __tablename__ = "fragment_versions"
    __table_args__ = (
        Index("ix_fragment_versions_run_created", "run_id", "created_at"),
        Index("ix_fragment_versions_token", "run_id", "lease_token", "fragment", "version"),
        Index("ix_fragment_versions_gc", "run_id", "fragment", "version", sqlite_where=GC_VERSIONS, postgresql_where=GC_VERSIONS),
    )

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    fragment: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())
    blob_key: Mapped[str] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64))
    nbytes: Mapped[int] = mapped_column(BigInteger)
    state_key: Mapped[str] = mapped_column(Text)
    """Blob of the outer optimizer's state after this version (momentum), for exact resume."""
    state_sha256: Mapped[str] = mapped_column(String(64))
    lease_token: Mapped[int] = mapped_column(BigInteger)
    """Fencing token of the synchronizer that published this version."""
    synchronizer: Mapped[str] = mapped_column(String(128))
    blob_deleted: Mapped[bool] = mapped_column(Boolean, default=False)
    gc_done: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    """GC has settled this version's blob: deleted it, or keeps it for good (a checkpoint)."""
    compact_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    """The version's compact form for downloads (``platform/compact.py``: delta, base, step); null without one."""


class FragmentHead(Base):
    """The newest version of a fragment (a copy of its ``fragment_versions`` row) and the fragment's running
    totals, rewritten by every publish in the same transaction: what every per-step read needs, in P rows."""

    __tablename__ = "fragment_heads"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    fragment: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())
    blob_key: Mapped[str] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64))
    nbytes: Mapped[int] = mapped_column(BigInteger)
    state_key: Mapped[str] = mapped_column(Text)
    state_sha256: Mapped[str] = mapped_column(String(64))
    lease_token: Mapped[int] = mapped_column(BigInteger)
    synchronizer: Mapped[str] = mapped_column(String(128))
    compact_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    published_s: Mapped[float] = mapped_column(Float)
    """``created_at`` as seconds since the epoch (portable arithmetic for the gap below)."""
    tokens_merged: Mapped[int] = mapped_column(BigInteger, default=0)
    submissions_merged: Mapped[int] = mapped_column(BigInteger, default=0)
    longest_gap_s: Mapped[float] = mapped_column(Float, default=0.0)
    """Longest wait, seen by this fragment's merges, since the run's previous merged version (any fragment)."""


class Merge(Base):
    __tablename__ = "merges"
    __table_args__ = (Index("ix_merges_run_fragment", "run_id", "fragment"), Index("ix_merges_run_at", "run_id", "at"))

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"))
    fragment: Mapped[int] = mapped_column(Integer)
    version: Mapped[int] = mapped_column(Integer)
    at: Mapped[datetime] = mapped_column(UtcDateTime())
    quorum: Mapped[int] = mapped_column(Integer)
    live_learners: Mapped[int] = mapped_column(Integer)
    included: Mapped[int] = mapped_column(Integer)
    rejected: Mapped[int] = mapped_column(Integer)
    grace_window_s: Mapped[float] = mapped_column(Float)
    grace_waited_s: Mapped[float] = mapped_column(Float)
    merge_s: Mapped[float] = mapped_column(Float)
    reason: Mapped[str] = mapped_column(Text)
    detail_json: Mapped[str] = mapped_column(Text)


class Event(Base):
    __tablename__ = "events"
    __table_args__ = (Index("ix_events_run_at", "run_id", "at"), Index("ix_events_run_kind_at", "run_id", "kind", "at"))

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(64))
    at: Mapped[datetime] = mapped_column(UtcDateTime())
    kind: Mapped[str] = mapped_column(String(32))
    actor: Mapped[str | None] = mapped_column(String(128), nullable=True)
    detail: Mapped[str] = mapped_column(Text, default="")


class Evaluation(Base):
    __tablename__ = "evaluations"
    __table_args__ = (Index("ix_evaluations_run_at", "run_id", "at"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"))
    at: Mapped[datetime] = mapped_column(UtcDateTime())
    tokens: Mapped[int] = mapped_column(BigInteger)
    versions_total: Mapped[int] = mapped_column(Integer)
    val_loss: Mapped[float] = mapped_column(Float)
    val_accuracy: Mapped[float | None] = mapped_column(Float, nullable=True)


class SynchronizerLease(Base):
    __tablename__ = "synchronizer_leases"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    shard: Mapped[int] = mapped_column(Integer, primary_key=True, default=0, server_default="0")
    """Which shard of the run's fragments this lease covers (0 when the run has one synchronizer shard)."""
    holder: Mapped[str] = mapped_column(String(128))
    token: Mapped[int] = mapped_column(BigInteger)
    """Fencing token: grows by one at every change of holder."""
    acquired_at: Mapped[datetime] = mapped_column(UtcDateTime())
    expires_at: Mapped[datetime] = mapped_column(UtcDateTime())
    presence: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    """The holder held the shard's presence lock when it last wrote this row (``ledger.presence``): a standby that
    gets that lock knows the holder is gone and takes over without waiting for ``expires_at``."""
