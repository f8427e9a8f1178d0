"""Schema migrations (backend/database/schema.py): the revisions make the models' tables, and an older database is
upgraded at
start-up without losing a row."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine
from sqlmodel import SQLModel

from backend.context import PanelContext
from backend.database import schema
from backend.database.connection import Database
from backend.ingestion import ingest
from backend.services.adapters import AdapterService
from backend.services.queries import QueryService
from backend.services.runs import RunService

FIXTURE = Path(__file__).parents[1] / "fixtures" / "panel-db-875c2e2.sql"
REPO = Path(__file__).resolve().parents[2]


def _differences(engine) -> list:
    with engine.connect() as connection:
        return compare_metadata(MigrationContext.configure(connection), SQLModel.metadata)


def _row_counts(path: Path) -> dict[str, int]:
    with sqlite3.connect(path) as connection:
        tables = [name for (name,) in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {table: connection.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0] for table in tables}


def _from_fixture(path: Path) -> Path:
    with sqlite3.connect(path) as connection:
        connection.executescript(FIXTURE.read_text())
    return path


def test_the_revisions_replayed_from_nothing_make_exactly_the_tables_the_models_declare(tmp_path):
    """A new database gets the models' tables at once (and is stamped); one upgraded revision by revision must end up
    the same. Fails when backend/database/models.py changes without a revision
    (`python -m backend.database.schema revision ...`)."""
    engine = create_engine(f"sqlite:///{tmp_path / 'replayed.sqlite3'}")
    with engine.begin() as connection:
        command.upgrade(schema._config(connection), "head")
    assert _differences(engine) == []
    fresh = Database(tmp_path / "fresh.sqlite3")
    assert _differences(fresh.engine) == []
    with fresh.engine.connect() as connection:
        assert MigrationContext.configure(connection).get_current_revision() == schema.head()


def test_a_database_made_by_the_oldest_schema_is_upgraded_at_start_up_without_losing_a_row(tmp_path):
    """The database as the panel of 2026-11-30 (commit 875c2e2) made it, with rows in every table: opening it adds
    what later releases added, keeps every row, and the services read it as before."""
    path = _from_fixture(tmp_path / "panel.sqlite3")
    before = _row_counts(path)
    assert "launch" not in before and "alembic_version" not in before
    db = Database(path)
    try:
        assert _differences(db.engine) == []
        after = _row_counts(path)
        assert {table: after[table] for table in before} == before
        assert after["launch"] == after["resumepoint"] == 0 and after["alembic_version"] == 1
        ctx = PanelContext(db, tmp_path)
        run = RunService(ctx, "alice").get("old-run")
        assert (run.status, run.step, run.current_version, run.replica_token_ciphertext) == (
            "finished",
            40,
            4,
            b"\x01\x02opaque",
        )
        assert [version.version for version in AdapterService(ctx, "alice").versions("old-run")] == [1, 2, 3, 4]
        assert [other.id for other in RunService(ctx, "bob").list()] == ["old-draft"]
    finally:
        db.close()
    assert _row_counts(path) == after  # opened again: nothing more to do
    Database(path).close()
    assert _row_counts(path) == after


def test_a_database_of_the_previous_release_gains_the_held_out_scores_at_start_up(tmp_path):
    """A panel at revision 0004 (before the `eval` stream) with a run: opening it adds the table the poller ingests
    held-out scores into, keeps the run, and scores can be written and read."""
    path = tmp_path / "panel.sqlite3"
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as connection:
        command.upgrade(schema._config(connection), "0004")
        connection.exec_driver_sql(
            "INSERT INTO run (id, owner, name, status, status_message, spec_json, storage_uri, backend, "
            "created_at, step, max_steps, cost_usd) "
            "VALUES ('kept', 'alice', '', 'finished', '', '{}', 'file:///x', 'local', 0, 40, 40, 0)"
        )
    engine.dispose()
    assert "versionscore" not in _row_counts(path)
    db = Database(path)
    try:
        assert _differences(db.engine) == []
        assert (_row_counts(path)["run"], _row_counts(path)["versionscore"]) == (1, 0)
        record = {"version": 2, "step": 1, "key": "0123456789abcdef", "scores": {"reward": {"mean": 0.5}}}
        with db.session() as session:
            ingest.ingest_eval(session, "kept", "alice", [record])
            session.commit()
        best = QueryService(PanelContext(db, tmp_path), "alice").best_by_eval("kept")
        assert best is not None and (best.version, best.mean, best.low) == (2, 0.5, None)
    finally:
        db.close()


def test_a_database_made_between_the_oldest_schema_and_migrations_is_stamped_and_kept(tmp_path):
    """Panels from before migrations made every table they knew with create_all: such a database has today's tables
    but no revision. It is taken as it is (nothing created twice), its rows kept."""
    path = tmp_path / "panel.sqlite3"
    engine = create_engine(f"sqlite:///{path}")
    SQLModel.metadata.create_all(engine)
    with engine.begin() as connection:
        connection.exec_driver_sql(
            "INSERT INTO run (id, owner, name, status, status_message, spec_json, storage_uri, backend, "
            "created_at, step, max_steps, cost_usd) "
            "VALUES ('kept', 'alice', '', 'draft', '', '{}', 'file:///x', 'local', 0, 0, 0, 0)"
        )
        connection.exec_driver_sql(
            "INSERT INTO launch (run_id, owner, step, holder, renewed_at, takeovers, updated_at, message) "
            "VALUES ('kept', 'alice', 'trainer', 'h:1:n', 0, 0, 0, '')"
        )
    engine.dispose()
    db = Database(path)
    try:
        assert _differences(db.engine) == []
        counts = _row_counts(path)
        assert (counts["run"], counts["launch"], counts["alembic_version"]) == (1, 1, 1)
    finally:
        db.close()


def test_processes_opening_one_new_database_at_once_all_get_its_tables(tmp_path):
    """A panel and CLI commands may open the same new database together: the migration runs once, under a lock."""
    path = tmp_path / "shared.sqlite3"
    script = (
        f"import sys; sys.path.insert(0, {str(REPO)!r}); "
        f"from backend.database.connection import Database; Database({str(path)!r})"
    )
    openers = [subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE) for _ in range(4)]
    errors = [opener.communicate(timeout=120)[1].decode() for opener in openers]
    assert [opener.returncode for opener in openers] == [0] * 4, errors
    engine = create_engine(f"sqlite:///{path}")
    assert _differences(engine) == [] and _row_counts(path)["alembic_version"] == 1


def test_a_new_revision_is_generated_from_the_models(tmp_path, monkeypatch):
    """`python -m backend.database.schema revision` compares the models with the replayed revisions: with nothing
    changed, the revision it writes (into a copy of the migrations here) has nothing to do."""
    copy = tmp_path / "migrations"
    shutil.copytree(schema.MIGRATIONS, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(schema, "MIGRATIONS", copy)
    schema.head.cache_clear()
    try:
        path = schema.new_revision("Nothing changed")
        assert path == copy / "versions" / f"{int(schema.head()) + 1:04d}_nothing_changed.py"
        upgrade_body = path.read_text().split("def upgrade() -> None:")[1].split("def downgrade")[0]
        statements = [line.strip() for line in upgrade_body.splitlines() if line.strip() and "#" not in line]
        assert statements == ["pass"], upgrade_body
    finally:
        schema.head.cache_clear()


def test_the_oldest_fixture_has_rows_in_every_table_it_has(tmp_path):
    """The upgrade test proves rows survive only for tables its fixture fills."""
    counts = _row_counts(_from_fixture(tmp_path / "panel.sqlite3"))
    assert len(counts) == 10 and all(counts.values()), counts  # that release had ten tables
