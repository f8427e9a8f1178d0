"""The tables as the first released panel made them (commit 875c2e2), before migrations existed.

A database made by that release (or by any later one before migrations, which only added tables) is stamped with
this revision at start-up, then upgraded.
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "credential",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("owner", sa.String(), nullable=False),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("ciphertext", sa.LargeBinary(), nullable=False),
        sa.Column("masked", sa.String(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("owner", "name"),
    )
    op.create_index(op.f("ix_credential_owner"), "credential", ["owner"], unique=False)
    op.create_table(
        "run",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("owner", sa.String(), nullable=False),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("status_message", sa.String(), nullable=False),
        sa.Column("spec_json", sa.String(), nullable=False),
        sa.Column("storage_uri", sa.String(), nullable=False),
        sa.Column("backend", sa.String(), nullable=False),
        sa.Column("parent_run_id", sa.String(), nullable=True),
        sa.Column("parent_version", sa.Integer(), nullable=True),
        sa.Column("store_credential_id", sa.Integer(), nullable=True),
        sa.Column("replica_token_ciphertext", sa.LargeBinary(), nullable=True),
        sa.Column("hf_credential_id", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=True),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.Column("stop_requested_at", sa.Float(), nullable=True),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("max_steps", sa.Integer(), nullable=False),
        sa.Column("latest_reward", sa.Float(), nullable=True),
        sa.Column("current_version", sa.Integer(), nullable=True),
        sa.Column("best_version", sa.Integer(), nullable=True),
        sa.Column("cost_usd", sa.Float(), nullable=False),
        sa.Column("last_telemetry_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(op.f("ix_run_owner"), "run", ["owner"], unique=False)
    op.create_index(op.f("ix_run_parent_run_id"), "run", ["parent_run_id"], unique=False)
    op.create_table(
        "adapterversion",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(), nullable=False),
        sa.Column("owner", sa.String(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("size_bytes", sa.Integer(), nullable=False),
        sa.Column("manifest_json", sa.String(), nullable=False),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("audit_max_diff", sa.Float(), nullable=True),
        sa.Column("audit_ok", sa.Boolean(), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["run.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("run_id", "version"),
    )
    op.create_index(op.f("ix_adapterversion_owner"), "adapterversion", ["owner"], unique=False)
    op.create_index(op.f("ix_adapterversion_run_id"), "adapterversion", ["run_id"], unique=False)
    op.create_table(
        "event",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(), nullable=True),
        sa.Column("owner", sa.String(), nullable=False),
        sa.Column("time", sa.Float(), nullable=False),
        sa.Column("level", sa.String(), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("message", sa.String(), nullable=False),
        sa.Column("active", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["run.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(op.f("ix_event_owner"), "event", ["owner"], unique=False)
    op.create_index("ix_event_run_time", "event", ["run_id", "time"], unique=False)
    op.create_table(
        "job",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(), nullable=False),
        sa.Column("owner", sa.String(), nullable=False),
        sa.Column("role", sa.String(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("backend_job_id", sa.String(), nullable=False),
        sa.Column("stage", sa.String(), nullable=False),
        sa.Column("url", sa.String(), nullable=True),
        sa.Column("endpoint", sa.String(), nullable=True),
        sa.Column("flavor", sa.String(), nullable=False),
        sa.Column("price_per_hour", sa.Float(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=True),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.Column("log_tail", sa.String(), nullable=False),
        sa.Column("message", sa.String(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["run.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("run_id", "role", "attempt"),
    )
    op.create_index(op.f("ix_job_owner"), "job", ["owner"], unique=False)
    op.create_index(op.f("ix_job_run_id"), "job", ["run_id"], unique=False)
    op.create_table(
        "metricpoint",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(), nullable=False),
        sa.Column("owner", sa.String(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("time", sa.Float(), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["run.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_metric_run_name_step", "metricpoint", ["run_id", "name", "step"], unique=False)
    op.create_table(
        "pollcursor",
        sa.Column("run_id", sa.String(), nullable=False),
        sa.Column("stream", sa.String(), nullable=False),
        sa.Column("cursor", sa.String(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["run.id"],
        ),
        sa.PrimaryKeyConstraint("run_id", "stream"),
    )
    op.create_table(
        "proxysnapshot",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(), nullable=False),
        sa.Column("owner", sa.String(), nullable=False),
        sa.Column("time", sa.Float(), nullable=False),
        sa.Column("stats_json", sa.String(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["run.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_proxy_run_order", "proxysnapshot", ["run_id", "id"], unique=False)
    op.create_table(
        "replicastatus",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(), nullable=False),
        sa.Column("owner", sa.String(), nullable=False),
        sa.Column("role", sa.String(), nullable=False),
        sa.Column("time", sa.Float(), nullable=False),
        sa.Column("data_json", sa.String(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["run.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("run_id", "role"),
    )
    op.create_index(op.f("ix_replicastatus_run_id"), "replicastatus", ["run_id"], unique=False)
    op.create_table(
        "rolloutsample",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(), nullable=False),
        sa.Column("owner", sa.String(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("policy_version", sa.Integer(), nullable=False),
        sa.Column("staleness", sa.Integer(), nullable=False),
        sa.Column("group_id", sa.Integer(), nullable=False),
        sa.Column("prompt", sa.String(), nullable=False),
        sa.Column("completion", sa.String(), nullable=False),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("rewards_json", sa.String(), nullable=False),
        sa.Column("advantage", sa.Float(), nullable=False),
        sa.Column("dropped", sa.Boolean(), nullable=False),
        sa.Column("time", sa.Float(), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["run.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_sample_run_step", "rolloutsample", ["run_id", "step"], unique=False)


def downgrade() -> None:
    raise NotImplementedError("the baseline cannot be undone")
