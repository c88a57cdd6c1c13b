"""synchronizer shards (one lease per shard of a run's fragments), and each learner's upload link state
(queue depth, age of the oldest unsent increment, the send period and codec it chose and why)

Revision ID: 0005
Revises: 0004
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LINK_COLUMNS = ("queue_depth", "oldest_unsent_s", "link_json")


def _link_columns() -> list[sa.Column]:
    return [
        sa.Column("queue_depth", sa.Integer(), nullable=True),
        sa.Column("oldest_unsent_s", sa.Float(), nullable=True),
        sa.Column("link_json", sa.Text(), nullable=True),
    ]


def upgrade() -> None:
    # Existing leases become shard 0: a run that never set synchronizer.shards is one shard, as before.
    with op.batch_alter_table("synchronizer_leases", recreate="always") as batch:
        batch.add_column(sa.Column("shard", sa.Integer(), nullable=False, server_default="0"))
        batch.drop_constraint("pk_synchronizer_leases", type_="primary")
        batch.create_primary_key("pk_synchronizer_leases", ["run_id", "shard"])
    for table in ("learners", "heartbeats"):
        with op.batch_alter_table(table) as batch:
            for column in _link_columns():
                batch.add_column(column)


def downgrade() -> None:
    for table in ("heartbeats", "learners"):
        with op.batch_alter_table(table) as batch:
            for column in reversed(LINK_COLUMNS):
                batch.drop_column(column)
    op.execute(sa.text("DELETE FROM synchronizer_leases WHERE shard <> 0"))
    with op.batch_alter_table("synchronizer_leases", recreate="always") as batch:
        batch.drop_constraint("pk_synchronizer_leases", type_="primary")
        batch.create_primary_key("pk_synchronizer_leases", ["run_id"])
        batch.drop_column("shard")
