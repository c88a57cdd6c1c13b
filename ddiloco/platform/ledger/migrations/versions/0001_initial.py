"""initial ledger schema

Revision ID: 0001
Revises: 
Create Date: 2026-11-21 23:46:25.789435
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


revision: str = '0001'
down_revision: Union[str, None] = None
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:

    op.create_table('events',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=64), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('actor', sa.String(length=128), nullable=True),
    sa.Column('detail', sa.Text(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_events'))
    )
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.create_index('ix_events_run_at', ['run_id', 'at'], unique=False)

    op.create_table('runs',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('config_json', sa.Text(), nullable=False),
    sa.Column('code_version', sa.String(length=64), nullable=False),
    sa.Column('git_commit', sa.String(length=64), nullable=True),
    sa.Column('num_fragments', sa.Integer(), nullable=False),
    sa.Column('token_budget', sa.BigInteger(), nullable=False),
    sa.Column('flow_run_url', sa.Text(), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_runs'))
    )
    op.create_table('evaluations',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=64), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('tokens', sa.BigInteger(), nullable=False),
    sa.Column('versions_total', sa.Integer(), nullable=False),
    sa.Column('val_loss', sa.Float(), nullable=False),
    sa.Column('val_accuracy', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_evaluations_run_id_runs')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_evaluations'))
    )
    with op.batch_alter_table('evaluations', schema=None) as batch_op:
        batch_op.create_index('ix_evaluations_run_at', ['run_id', 'at'], unique=False)

    op.create_table('fragment_specs',
    sa.Column('run_id', sa.String(length=64), nullable=False),
    sa.Column('fragment', sa.Integer(), nullable=False),
    sa.Column('tensors_json', sa.Text(), nullable=False),
    sa.Column('numel', sa.BigInteger(), nullable=False),
    sa.Column('nbytes', sa.BigInteger(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_fragment_specs_run_id_runs')),
    sa.PrimaryKeyConstraint('run_id', 'fragment', name=op.f('pk_fragment_specs'))
    )
    op.create_table('fragment_versions',
    sa.Column('run_id', sa.String(length=64), nullable=False),
    sa.Column('fragment', sa.Integer(), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('blob_key', sa.Text(), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('nbytes', sa.BigInteger(), nullable=False),
    sa.Column('state_key', sa.Text(), nullable=False),
    sa.Column('state_sha256', sa.String(length=64), nullable=False),
    sa.Column('lease_token', sa.BigInteger(), nullable=False),
    sa.Column('synchronizer', sa.String(length=128), nullable=False),
    sa.Column('blob_deleted', sa.Boolean(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_fragment_versions_run_id_runs')),
    sa.PrimaryKeyConstraint('run_id', 'fragment', 'version', name=op.f('pk_fragment_versions'))
    )
    op.create_table('learners',
    sa.Column('run_id', sa.String(length=64), nullable=False),
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('region', sa.String(length=64), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('incarnation', sa.Integer(), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_heartbeat_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('step', sa.BigInteger(), nullable=False),
    sa.Column('tokens_per_s', sa.Float(), nullable=False),
    sa.Column('step_time_s', sa.Float(), nullable=False),
    sa.Column('tokens_trained', sa.BigInteger(), nullable=False),
    sa.Column('tokens_submitted', sa.BigInteger(), nullable=False),
    sa.Column('tokens_lost', sa.BigInteger(), nullable=False),
    sa.Column('inc_tokens_trained', sa.BigInteger(), nullable=False),
    sa.Column('inc_tokens_submitted', sa.BigInteger(), nullable=False),
    sa.Column('busy_s', sa.Float(), nullable=False),
    sa.Column('optimizer_state_key', sa.Text(), nullable=True),
    sa.Column('optimizer_state_sha256', sa.String(length=64), nullable=True),
    sa.Column('flow_run_url', sa.Text(), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_learners_run_id_runs')),
    sa.PrimaryKeyConstraint('run_id', 'id', name=op.f('pk_learners'))
    )
    op.create_table('merges',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=64), nullable=False),
    sa.Column('fragment', sa.Integer(), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('quorum', sa.Integer(), nullable=False),
    sa.Column('live_learners', sa.Integer(), nullable=False),
    sa.Column('included', sa.Integer(), nullable=False),
    sa.Column('rejected', sa.Integer(), nullable=False),
    sa.Column('grace_window_s', sa.Float(), nullable=False),
    sa.Column('grace_waited_s', sa.Float(), nullable=False),
    sa.Column('merge_s', sa.Float(), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('detail_json', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_merges_run_id_runs')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_merges'))
    )
    with op.batch_alter_table('merges', schema=None) as batch_op:
        batch_op.create_index('ix_merges_run_fragment', ['run_id', 'fragment'], unique=False)

    op.create_table('synchronizer_leases',
    sa.Column('run_id', sa.String(length=64), nullable=False),
    sa.Column('holder', sa.String(length=128), nullable=False),
    sa.Column('token', sa.BigInteger(), nullable=False),
    sa.Column('acquired_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_synchronizer_leases_run_id_runs')),
    sa.PrimaryKeyConstraint('run_id', name=op.f('pk_synchronizer_leases'))
    )
    op.create_table('heartbeats',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=64), nullable=False),
    sa.Column('learner_id', sa.String(length=64), nullable=False),
    sa.Column('incarnation', sa.Integer(), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('step', sa.BigInteger(), nullable=False),
    sa.Column('tokens', sa.BigInteger(), nullable=False),
    sa.Column('loss', sa.Float(), nullable=True),
    sa.Column('tokens_per_s', sa.Float(), nullable=False),
    sa.Column('step_time_s', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['run_id', 'learner_id'], ['learners.run_id', 'learners.id'], name=op.f('fk_heartbeats_run_id_learners')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_heartbeats'))
    )
    with op.batch_alter_table('heartbeats', schema=None) as batch_op:
        batch_op.create_index('ix_heartbeats_run_learner_at', ['run_id', 'learner_id', 'at'], unique=False)

    op.create_table('submissions',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=64), nullable=False),
    sa.Column('learner_id', sa.String(length=64), nullable=False),
    sa.Column('uid', sa.String(length=64), nullable=False),
    sa.Column('fragment', sa.Integer(), nullable=False),
    sa.Column('base_version', sa.Integer(), nullable=False),
    sa.Column('c_steps', sa.Integer(), nullable=False),
    sa.Column('c_tokens', sa.BigInteger(), nullable=False),
    sa.Column('tokens_new', sa.BigInteger(), nullable=False),
    sa.Column('blob_key', sa.Text(), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('nbytes', sa.BigInteger(), nullable=False),
    sa.Column('codec', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('merged_version', sa.Integer(), nullable=True),
    sa.Column('merge_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=True),
    sa.Column('reject_reason', sa.Text(), nullable=True),
    sa.Column('decided_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('norm', sa.Float(), nullable=True),
    sa.Column('weight', sa.Float(), nullable=True),
    sa.Column('staleness', sa.Integer(), nullable=True),
    sa.Column('blob_deleted', sa.Boolean(), nullable=False),
    sa.ForeignKeyConstraint(['merge_id'], ['merges.id'], name=op.f('fk_submissions_merge_id_merges')),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_submissions_run_id_runs')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_submissions')),
    sa.UniqueConstraint('run_id', 'learner_id', 'uid', name='uq_submissions_run_learner_uid')
    )
    with op.batch_alter_table('submissions', schema=None) as batch_op:
        batch_op.create_index('ix_submissions_fragment_version', ['run_id', 'fragment', 'merged_version'], unique=False)
        batch_op.create_index('ix_submissions_poll', ['run_id', 'status', 'fragment'], unique=False)




def downgrade() -> None:

    with op.batch_alter_table('submissions', schema=None) as batch_op:
        batch_op.drop_index('ix_submissions_poll')
        batch_op.drop_index('ix_submissions_fragment_version')

    op.drop_table('submissions')
    with op.batch_alter_table('heartbeats', schema=None) as batch_op:
        batch_op.drop_index('ix_heartbeats_run_learner_at')

    op.drop_table('heartbeats')
    op.drop_table('synchronizer_leases')
    with op.batch_alter_table('merges', schema=None) as batch_op:
        batch_op.drop_index('ix_merges_run_fragment')

    op.drop_table('merges')
    op.drop_table('learners')
    op.drop_table('fragment_versions')
    op.drop_table('fragment_specs')
    with op.batch_alter_table('evaluations', schema=None) as batch_op:
        batch_op.drop_index('ix_evaluations_run_at')

    op.drop_table('evaluations')
    op.drop_table('runs')
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_index('ix_events_run_at')

    op.drop_table('events')

