"""events by kind: a learner's timeline (the summary's launches, joins and exits) seeks its kinds of events instead of
walking every event of the run, one per rejection included

Revision ID: 0009
Revises: 0008
"""
from collections.abc import Sequence

from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_events_run_kind_at", "events", ["run_id", "kind", "at"])


def downgrade() -> None:
    op.drop_index("ix_events_run_kind_at", table_name="events")
