"""a learner's world size (ranks of its job), recorded when an incarnation registers: the synchronizer judges its
tokens per step by it

Revision ID: 0008
Revises: 0007
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Rows of learners registered before this stay NULL: judged by learners.max_world_size until they re-register.
    with op.batch_alter_table("learners") as batch:
        batch.add_column(sa.Column("world_size", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("learners") as batch:
        batch.drop_column("world_size")
