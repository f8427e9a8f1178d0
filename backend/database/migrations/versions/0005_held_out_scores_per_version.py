"""Held-out scores per adapter version: what the trainer's evaluator writes to the `eval` telemetry stream.

A database stamped at the baseline may have been made by `create_all` with this table already: it is created only
where missing, as 0002 does.
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if "versionscore" in sa.inspect(op.get_bind()).get_table_names():
        return
    op.create_table(
        "versionscore",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(), nullable=False),
        sa.Column("owner", sa.String(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(), nullable=False),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("mean", sa.Float(), nullable=False),
        sa.Column("low", sa.Float(), nullable=True),
        sa.Column("high", sa.Float(), nullable=True),
        sa.Column("pass_at_k", sa.Float(), nullable=True),
        sa.Column("prompts", sa.Integer(), nullable=False),
        sa.Column("k", sa.Integer(), nullable=False),
        sa.Column("time", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["run.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("run_id", "version", "key", "name"),
    )
    op.create_index(op.f("ix_versionscore_run_id"), "versionscore", ["run_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_versionscore_run_id"), table_name="versionscore")
    op.drop_table("versionscore")
