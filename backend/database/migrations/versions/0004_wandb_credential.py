"""A run's W&B key: the credential its trainer reports to Weights & Biases with (none for runs stored before)."""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Only where missing, as 0003: a database stamped at the baseline may have been made by `create_all` with it.
    if "wandb_credential_id" not in {column["name"] for column in sa.inspect(op.get_bind()).get_columns("run")}:
        with op.batch_alter_table("run", schema=None) as batch_op:
            batch_op.add_column(sa.Column("wandb_credential_id", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("run", schema=None) as batch_op:
        batch_op.drop_column("wandb_credential_id")
