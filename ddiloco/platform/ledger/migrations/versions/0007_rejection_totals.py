"""rejection totals: rejected work per (run, learner id, reason class), kept by every rejection, so the dashboard's
per-learner fates and the summary's reasons no longer read every rejected submission

Revision ID: 0007
Revises: 0006
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from ddiloco.platform.ledger.rejections import reason_class

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    table = op.create_table(
        "rejection_totals",
        sa.Column("run_id", sa.String(64), sa.ForeignKey("runs.id", name="fk_rejection_totals_run_id_runs"), nullable=False),
        sa.Column("learner_id", sa.String(64), nullable=False),
        sa.Column("reason", sa.String(64), nullable=False),
        sa.Column("submissions", sa.BigInteger(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("nbytes", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "learner_id", "reason", name="pk_rejection_totals"),
    )
    # The one scan of the rejected rows, here; the class of a reason is the rule the rejections keep them by.
    grouped = op.get_bind().execute(sa.text(
        "SELECT run_id, learner_id, reject_reason, count(*), coalesce(sum(tokens_new), 0), coalesce(sum(nbytes), 0) "
        "FROM submissions WHERE status = 'rejected' GROUP BY run_id, learner_id, reject_reason"
    ))
    totals: dict[tuple[str, str, str], list[int]] = {}
    for run_id, learner_id, reason, n, tokens, nbytes in grouped:
        t = totals.setdefault((run_id, learner_id, reason_class(reason)), [0, 0, 0])
        t[0], t[1], t[2] = t[0] + int(n), t[1] + int(tokens), t[2] + int(nbytes)
    if totals:
        op.bulk_insert(table, [
            {"run_id": r, "learner_id": lid, "reason": why, "submissions": n, "tokens": t, "nbytes": b}
            for (r, lid, why), (n, t, b) in totals.items()
        ])


def downgrade() -> None:
    op.drop_table("rejection_totals")
