"""a learner's data position (micro-batches drawn per rank) as of its newest registered submission

Revision ID: 0003
Revises: 0002
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("learners") as batch:
        batch.add_column(sa.Column("data_batches", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("learners") as batch:
        batch.drop_column("data_batches")
