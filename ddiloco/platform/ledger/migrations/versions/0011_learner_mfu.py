"""a learner's model FLOP/s per device and its MFU, written by every beat to its row and its heartbeats: the dashboard
shows how well each learner's hardware is used

Revision ID: 0011
Revises: 0010
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ("model_flops_per_s", "mfu")


def upgrade() -> None:
    # NULL where a learner never reported them: beats before this, a model that cannot be counted, a device with no
    # published peak (MFU only).
    for table in ("learners", "heartbeats"):
        with op.batch_alter_table(table) as batch:
            for column in COLUMNS:
                batch.add_column(sa.Column(column, sa.Float(), nullable=True))


def downgrade() -> None:
    for table in ("heartbeats", "learners"):
        with op.batch_alter_table(table) as batch:
            for column in reversed(COLUMNS):
                batch.drop_column(column)
