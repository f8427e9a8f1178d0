"""Alert history: the step an alert was raised at, when it cleared, and whether its owner dismissed it.

Events already stored keep their rows: the new columns are empty for them (and `dismissed` false).
"""

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Only where missing: a database stamped at the baseline may have been made with these columns already (by
    # `create_all` from models that had them), as 0002 creates its tables only where missing.
    existing = {column["name"] for column in sa.inspect(op.get_bind()).get_columns("event")}
    columns: list[sa.Column[Any]] = [
        sa.Column("step", sa.Integer(), nullable=True),
        sa.Column("cleared_at", sa.Float(), nullable=True),
        sa.Column("dismissed", sa.Boolean(), nullable=False, server_default=sa.false()),
    ]
    missing = [column for column in columns if column.name not in existing]
    if missing:
        with op.batch_alter_table("event", schema=None) as batch_op:
            for column in missing:
                batch_op.add_column(column)


def downgrade() -> None:
    with op.batch_alter_table("event", schema=None) as batch_op:
        batch_op.drop_column("dismissed")
        batch_op.drop_column("cleared_at")
        batch_op.drop_column("step")
