"""per-step reads that do not grow with history: fragment heads with running totals, learner totals,
and indexes that serve GC, rejections and time-ordered reads by seek

Revision ID: 0004
Revises: 0003
"""
from collections.abc import Sequence
from datetime import timezone

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

GC_SUBMISSIONS = sa.text("status <> 'pending' AND blob_deleted = false")
REJECTED_ROWS = sa.text("status = 'rejected'")
GC_VERSIONS = sa.text("gc_done = false")


def upgrade() -> None:
    op.create_table(
        "fragment_heads",
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("fragment", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("blob_key", sa.Text(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("nbytes", sa.BigInteger(), nullable=False),
        sa.Column("state_key", sa.Text(), nullable=False),
        sa.Column("state_sha256", sa.String(length=64), nullable=False),
        sa.Column("lease_token", sa.BigInteger(), nullable=False),
        sa.Column("synchronizer", sa.String(length=128), nullable=False),
        sa.Column("published_s", sa.Float(), nullable=False),
        sa.Column("tokens_merged", sa.BigInteger(), nullable=False),
        sa.Column("submissions_merged", sa.BigInteger(), nullable=False),
        sa.Column("longest_gap_s", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_fragment_heads_run_id_runs")),
        sa.PrimaryKeyConstraint("run_id", "fragment", name=op.f("pk_fragment_heads")),
    )
    with op.batch_alter_table("learners") as batch:
        batch.add_column(sa.Column("submissions", sa.BigInteger(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("tokens_sent", sa.BigInteger(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("bytes_sent", sa.BigInteger(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("last_submission_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("loss", sa.Float(), nullable=True))
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("tokens_rejected", sa.BigInteger(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("submissions_rejected", sa.BigInteger(), nullable=False, server_default="0"))
    postgres = op.get_bind().dialect.name == "postgresql"
    # On PostgreSQL the column starts true (no rewrite) and only the versions GC has not settled, a few per
    # fragment, are set false: ``gc_done = blob_deleted`` over every row left the old row versions of the whole
    # history in ``ix_fragment_versions_gc`` (built in the same transaction, it indexes them), so every GC pass
    # walked millions of dead entries until a VACUUM (#15).
    with op.batch_alter_table("fragment_versions") as batch:
        batch.add_column(sa.Column("gc_done", sa.Boolean(), nullable=False, server_default=sa.true() if postgres else sa.false()))
    if postgres:
        op.execute("UPDATE fragment_versions SET gc_done = false WHERE NOT blob_deleted")
        op.alter_column("fragment_versions", "gc_done", server_default=sa.false())
    _backfill(set_gc_done=not postgres)
    with op.batch_alter_table("fragment_versions") as batch:
        batch.create_index("ix_fragment_versions_run_created", ["run_id", "created_at"], unique=False)
        batch.create_index("ix_fragment_versions_token", ["run_id", "lease_token", "fragment", "version"], unique=False)
        batch.create_index("ix_fragment_versions_gc", ["run_id", "fragment", "version"], unique=False,
                           sqlite_where=GC_VERSIONS, postgresql_where=GC_VERSIONS)
    with op.batch_alter_table("submissions") as batch:
        batch.create_index("ix_submissions_gc", ["run_id", "id"], unique=False,
                           sqlite_where=GC_SUBMISSIONS, postgresql_where=GC_SUBMISSIONS)
        batch.create_index("ix_submissions_rejected", ["run_id", "decided_at"], unique=False,
                           sqlite_where=REJECTED_ROWS, postgresql_where=REJECTED_ROWS)
    with op.batch_alter_table("merges") as batch:
        batch.create_index("ix_merges_run_at", ["run_id", "at"], unique=False)


def _backfill(*, set_gc_done: bool) -> None:
    """Derive the heads and totals of runs already in the ledger (the one full scan, here and not per step)."""
    conn = op.get_bind()
    if set_gc_done:
        conn.execute(sa.text("UPDATE fragment_versions SET gc_done = blob_deleted"))
    sent = conn.execute(sa.text(
        "SELECT run_id, learner_id, count(*), coalesce(sum(tokens_new), 0), coalesce(sum(nbytes), 0), max(created_at) "
        "FROM submissions GROUP BY run_id, learner_id"
    )).all()
    conn.execute(
        sa.text("UPDATE learners SET submissions = :n, tokens_sent = :t, bytes_sent = :b, last_submission_at = :at "
                "WHERE run_id = :r AND id = :l"),
        [{"r": r, "l": lid, "n": n, "t": t, "b": b, "at": at} for r, lid, n, t, b, at in sent],
    ) if sent else None
    conn.execute(sa.text(
        "UPDATE runs SET "
        "tokens_rejected = (SELECT coalesce(sum(s.tokens_new), 0) FROM submissions s WHERE s.run_id = runs.id "
        "AND s.status = 'rejected'), "
        "submissions_rejected = (SELECT count(*) FROM submissions s WHERE s.run_id = runs.id AND s.status = 'rejected')"
    ))
    conn.execute(sa.text(
        "UPDATE learners SET loss = (SELECT h.loss FROM heartbeats h WHERE h.run_id = learners.run_id "
        "AND h.learner_id = learners.id AND h.loss IS NOT NULL ORDER BY h.at DESC LIMIT 1)"
    ))
    merged = {
        (r, f): (int(t), int(n))
        for r, f, t, n in conn.execute(sa.text(
            "SELECT run_id, fragment, coalesce(sum(tokens_new), 0), count(*) FROM submissions "
            "WHERE status = 'merged' GROUP BY run_id, fragment"
        ))
    }
    # The longest wait before each merged version since the run's previous merged version (any fragment).
    gaps: dict[tuple[str, int], float] = {}
    previous: dict[str, float] = {}
    rows = conn.execute(sa.text(
        "SELECT run_id, fragment, created_at FROM fragment_versions WHERE version > 0 ORDER BY run_id, created_at"
    ).execution_options(stream_results=True, yield_per=10_000))
    for run_id, fragment, at in rows:
        t = _seconds(at)
        if run_id in previous:
            gaps[(run_id, fragment)] = max(gaps.get((run_id, fragment), 0.0), t - previous[run_id])
        previous[run_id] = t
    heads = conn.execute(sa.text(
        "SELECT v.run_id, v.fragment, v.version, v.created_at, v.blob_key, v.sha256, v.nbytes, v.state_key, "
        "v.state_sha256, v.lease_token, v.synchronizer FROM fragment_versions v "
        "JOIN (SELECT run_id, fragment, max(version) AS top FROM fragment_versions GROUP BY run_id, fragment) n "
        "ON n.run_id = v.run_id AND n.fragment = v.fragment AND n.top = v.version"
    )).all()
    table = sa.table(
        "fragment_heads", *[sa.column(c) for c in (
            "run_id", "fragment", "version", "created_at", "blob_key", "sha256", "nbytes", "state_key", "state_sha256",
            "lease_token", "synchronizer", "published_s", "tokens_merged", "submissions_merged", "longest_gap_s")]
    )
    values = [
        {
            "run_id": h.run_id, "fragment": h.fragment, "version": h.version, "created_at": h.created_at,
            "blob_key": h.blob_key, "sha256": h.sha256, "nbytes": h.nbytes, "state_key": h.state_key,
            "state_sha256": h.state_sha256, "lease_token": h.lease_token, "synchronizer": h.synchronizer,
            "published_s": _seconds(h.created_at), "tokens_merged": merged.get((h.run_id, h.fragment), (0, 0))[0],
            "submissions_merged": merged.get((h.run_id, h.fragment), (0, 0))[1],
            "longest_gap_s": gaps.get((h.run_id, h.fragment), 0.0),
        }
        for h in heads
    ]
    if values:
        op.bulk_insert(table, values)


def _seconds(at) -> float:  # noqa: ANN001 - a datetime, or SQLite's text form of one
    if isinstance(at, str):
        from datetime import datetime

        at = datetime.fromisoformat(at)
    if at.tzinfo is None:
        at = at.replace(tzinfo=timezone.utc)
    return at.timestamp()


def downgrade() -> None:
    with op.batch_alter_table("merges") as batch:
        batch.drop_index("ix_merges_run_at")
    with op.batch_alter_table("submissions") as batch:
        batch.drop_index("ix_submissions_rejected")
        batch.drop_index("ix_submissions_gc")
    with op.batch_alter_table("fragment_versions") as batch:
        batch.drop_index("ix_fragment_versions_gc")
        batch.drop_index("ix_fragment_versions_token")
        batch.drop_index("ix_fragment_versions_run_created")
        batch.drop_column("gc_done")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("submissions_rejected")
        batch.drop_column("tokens_rejected")
    with op.batch_alter_table("learners") as batch:
        for column in ("loss", "last_submission_at", "bytes_sent", "tokens_sent", "submissions"):
            batch.drop_column(column)
    op.drop_table("fragment_heads")
