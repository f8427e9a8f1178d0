"""Launches as recoverable state machines, and resume points that supersede a dead attempt's late records.

Databases made between the first release and migrations may already have these tables (create_all made them): they are
created only where missing.
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    existing = set(sa.inspect(op.get_bind()).get_table_names())
    if "launch" not in existing:
        op.create_table(
            "launch",
            sa.Column("run_id", sa.String(), nullable=False),
            sa.Column("owner", sa.String(), nullable=False),
            sa.Column("step", sa.String(), nullable=False),
            sa.Column("holder", sa.String(), nullable=False),
            sa.Column("renewed_at", sa.Float(), nullable=False),
            sa.Column("takeovers", sa.Integer(), nullable=False),
            sa.Column("updated_at", sa.Float(), nullable=False),
            sa.Column("message", sa.String(), nullable=False),
            sa.ForeignKeyConstraint(
                ["run_id"],
                ["run.id"],
            ),
            sa.PrimaryKeyConstraint("run_id"),
        )
    if "resumepoint" not in existing:
        op.create_table(
            "resumepoint",
            sa.Column("run_id", sa.String(), nullable=False),
            sa.Column("attempt", sa.Integer(), nullable=False),
            sa.Column("resumed_from_step", sa.Integer(), nullable=False),
            sa.ForeignKeyConstraint(
                ["run_id"],
                ["run.id"],
            ),
            sa.PrimaryKeyConstraint("run_id", "attempt"),
        )


def downgrade() -> None:
    op.drop_table("resumepoint")
    op.drop_table("launch")
