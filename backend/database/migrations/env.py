"""Alembic's entry point: run the migrations on the connection backend/database/schema.py hands over (no alembic.ini,
no URL)."""

from alembic import context
from sqlmodel import SQLModel

from backend.database import models  # noqa: F401  (registers the tables the revisions are compared against)

context.configure(
    connection=context.config.attributes["connection"],
    target_metadata=SQLModel.metadata,
    render_as_batch=True,  # SQLite alters a table by copying it: Alembic's batch mode does that
)
with context.begin_transaction():
    context.run_migrations()
