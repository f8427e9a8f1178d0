"""Agent episodes turn by turn: a rollout sample's turns as JSON (backend/ingestion/episodes.py); NULL for a single
reply, as every sample ingested before this revision.

Only where missing, as 0004: a database stamped at the baseline may have been made by `create_all` with it. SQLite
adds the column in place (no copy of a table that may hold millions of samples).
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if "turns_json" not in {column["name"] for column in sa.inspect(op.get_bind()).get_columns("rolloutsample")}:
        with op.batch_alter_table("rolloutsample", schema=None) as batch_op:
            batch_op.add_column(sa.Column("turns_json", sa.String(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("rolloutsample", schema=None) as batch_op:
        batch_op.drop_column("turns_json")
