"""a lease says whether its holder holds the shard's presence lock: a standby that gets that lock takes over at once

Revision ID: 0010
Revises: 0009
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Leases written before this say nothing of a presence lock: only their expiry hands them over.
    with op.batch_alter_table("synchronizer_leases") as batch:
        batch.add_column(sa.Column("presence", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("synchronizer_leases") as batch:
        batch.drop_column("presence")
