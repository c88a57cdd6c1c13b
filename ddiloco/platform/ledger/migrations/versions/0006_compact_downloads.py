"""compact downloads: each published version's compact form (delta from a base learners hold, the base, the
step to it) on its version row and on the fragment's head

Revision ID: 0006
Revises: 0005
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable: versions published before have no compact form; learners download those whole, as before.
    for table in ("fragment_versions", "fragment_heads"):
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("compact_json", sa.Text(), nullable=True))


def downgrade() -> None:
    for table in ("fragment_heads", "fragment_versions"):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("compact_json")
