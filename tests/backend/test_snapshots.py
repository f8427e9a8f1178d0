"""The panel's database snapshots (issue 16): SQLite on local disk, a consistent copy on the durable volume.

The mid-run case — the panel dies after a snapshot, its database is lost, it comes back and the poller catches up
from the run's bucket without counting anything twice — is tests/test_e2e_demo.py's
`test_a_panel_that_lost_its_database_mid_run_comes_back_from_its_snapshot`, on the module's demo run.
"""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

from backend.context import PanelContext
from backend.database.connection import Database
from backend.database.snapshots import SNAPSHOT_NAME, restore_snapshot, write_snapshot
from backend.services.runs import RunService
from jobs.demo.preset import demo_spec
from jobs.ports import free_port
from tests.support.net import wait_http

ROOT = Path(__file__).resolve().parents[2]


def run_ids(database: Path) -> list[str]:
    with sqlite3.connect(database) as connection:
        return [row[0] for row in connection.execute("SELECT id FROM run ORDER BY id")]


def test_a_snapshot_holds_what_was_committed_while_a_write_is_still_open(tmp_path):
    ctx = PanelContext(Database(tmp_path / "data" / "panel.sqlite3"), tmp_path / "data")
    RunService(ctx, "local").create(demo_spec("committed", f"file://{tmp_path / 'store'}"))
    writer = sqlite3.connect(ctx.db.path, timeout=5)
    writer.execute("BEGIN IMMEDIATE")
    writer.execute("UPDATE run SET name = 'half-done' WHERE id = 'committed'")  # not committed yet
    try:
        snapshot = write_snapshot(ctx.db.path, tmp_path / "volume")
    finally:
        writer.rollback()
        writer.close()
    assert snapshot.name == SNAPSHOT_NAME and not list((tmp_path / "volume").glob(".*"))  # no staging file left
    with sqlite3.connect(snapshot) as copy:
        assert copy.execute("SELECT id, name FROM run").fetchall() == [("committed", "Demo on this machine")]
        assert copy.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    ctx.db.close()


def test_a_snapshot_is_restored_only_in_place_of_a_missing_database(tmp_path):
    ctx = PanelContext(Database(tmp_path / "data" / "panel.sqlite3"), tmp_path / "data")
    RunService(ctx, "local").create(demo_spec("kept-run", f"file://{tmp_path / 'store'}"))
    write_snapshot(ctx.db.path, tmp_path / "volume")
    ctx.db.close()
    assert not restore_snapshot(ctx.db.path, tmp_path / "volume")  # a database is there: it wins
    assert not restore_snapshot(tmp_path / "elsewhere.sqlite3", tmp_path / "no-volume")  # nothing to restore
    assert restore_snapshot(tmp_path / "fresh" / "panel.sqlite3", tmp_path / "volume")
    assert run_ids(tmp_path / "fresh" / "panel.sqlite3") == ["kept-run"]


def start_panel(data: Path, volume: Path, port: int) -> subprocess.Popen:
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("SPACE_ID", "SYSTEM", "GRADIO_SERVER_NAME")},
        "GRPO_PANEL_DATA": str(data),
        "GRPO_PANEL_SNAPSHOTS": str(volume),
        "GRADIO_SERVER_PORT": str(port),
        "GRADIO_ANALYTICS_ENABLED": "False",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "app"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wait_http(f"http://127.0.0.1:{port}/", timeout=120)
    return process


def stop_panel(process: subprocess.Popen) -> int:
    process.send_signal(signal.SIGTERM)  # how a Space is stopped
    return process.wait(timeout=60)


def test_the_panel_snapshots_on_sigterm_and_a_fresh_start_restores_it(tmp_path):
    """`python -m app` as a Space runs it: stopped with SIGTERM it writes its last snapshot; started again on an
    empty disk it comes back with its runs."""
    data, volume = tmp_path / "data", tmp_path / "volume"
    ctx = PanelContext(Database(data / "panel.sqlite3"), data)
    RunService(ctx, "local").create(demo_spec("before-restart", f"file://{tmp_path / 'store'}"))
    ctx.db.close()
    panel = start_panel(data, volume, free_port())
    assert stop_panel(panel) == 0
    assert run_ids(volume / SNAPSHOT_NAME) == ["before-restart"]
    shutil.rmtree(data)  # the Space's disk after a restart
    panel = start_panel(data, volume, free_port())
    try:
        assert run_ids(data / "panel.sqlite3") == ["before-restart"]
    finally:
        stop_panel(panel)
