"""The SQLite schema: tables, WAL mode, indexes, owner columns."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import inspect, text
from sqlalchemy.exc import IntegrityError
from sqlmodel import select

from backend.database.connection import Database, data_dir
from backend.database.models import AdapterVersion, MetricPoint, Run


@pytest.fixture
def db(tmp_path):
    database = Database(tmp_path / "panel.sqlite3")
    yield database
    database.close()


def _run(run_id: str = "run-1", owner: str = "alice") -> Run:
    return Run(
        id=run_id, owner=owner, spec_json="{}", storage_uri="file:///tmp/s", backend="local", created_at=time.time()
    )


def test_wal_mode_and_foreign_keys(db):
    with db.engine.connect() as connection:
        assert connection.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert connection.execute(text("PRAGMA foreign_keys")).scalar() == 1


def test_every_user_visible_table_has_an_owner(db):
    inspector = inspect(db.engine)
    for table in (
        "run",
        "job",
        "adapterversion",
        "metricpoint",
        "rolloutsample",
        "proxysnapshot",
        "replicastatus",
        "event",
        "credential",
    ):
        assert "owner" in {column["name"] for column in inspector.get_columns(table)}, table


def test_run_step_indexes_exist(db):
    inspector = inspect(db.engine)
    metric_indexes = {index["name"]: index["column_names"] for index in inspector.get_indexes("metricpoint")}
    assert metric_indexes["ix_metric_run_name_step"] == ["run_id", "name", "step"]
    sample_indexes = {index["name"]: index["column_names"] for index in inspector.get_indexes("rolloutsample")}
    assert sample_indexes["ix_sample_run_step"] == ["run_id", "step"]


def test_rows_round_trip_and_constraints_hold(db):
    with db.session() as session:
        session.add(_run())
        session.commit()
        session.add(AdapterVersion(run_id="run-1", owner="alice", version=1, step=4, created_at=time.time()))
        session.add(MetricPoint(run_id="run-1", owner="alice", step=1, name="reward", value=0.5))
        session.commit()
    with db.session() as session:
        assert session.exec(select(MetricPoint.value).where(MetricPoint.run_id == "run-1")).all() == [0.5]
        session.add(AdapterVersion(run_id="run-1", owner="alice", version=1, created_at=time.time()))
        with pytest.raises(IntegrityError):
            session.commit()
        session.rollback()
        session.add(MetricPoint(run_id="no-such-run", owner="alice", step=1, name="reward", value=1.0))
        with pytest.raises(IntegrityError):
            session.commit()


def test_data_dir_is_configurable(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_PANEL_DATA", str(tmp_path / "elsewhere"))
    assert data_dir() == tmp_path / "elsewhere"
    assert (tmp_path / "elsewhere").is_dir()
