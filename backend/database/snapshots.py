"""The panel's database kept where a restart finds it, without running SQLite on a network mount.

A Space's disk is lost on every restart, and the durable place it has — a mounted bucket volume — is a network
filesystem with lazy fetches, where SQLite's locking (WAL above all) is not safe. So the database stays on local disk,
and a consistent copy (SQLite's online backup API: a snapshot of one committed state, taken while the poller writes)
goes to the durable folder every few minutes and when the panel shuts down. At start, a panel whose local database
is missing restores the newest copy; whatever the runs wrote since (metrics, samples, versions, events) the poller
re-reads from their buckets, where it always was, and the database's unique keys keep it from counting anything twice.

    GRPO_PANEL_SNAPSHOTS=/data    # the folder (a mounted volume); unset: no snapshots

Credentials are in the copy encrypted, as in the database: their key is the Space's `GRPO_PANEL_KEY` secret, never
written next to them.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from pathlib import Path

from backend import settings

SNAPSHOT_NAME = "panel.sqlite3.snapshot"
INTERVAL_S = 300.0

log = logging.getLogger(__name__)


def snapshot_folder(environ: dict[str, str] | None = None) -> Path | None:
    value = settings.SNAPSHOTS.get(environ)
    return Path(value) if value else None


def write_snapshot(database: Path, folder: Path) -> Path:
    """Copy one committed state of `database` to `folder` (atomically: a reader never sees half a copy)."""
    folder.mkdir(parents=True, exist_ok=True)
    target, staging = folder / SNAPSHOT_NAME, folder / f".{SNAPSHOT_NAME}.tmp"
    staging.unlink(missing_ok=True)
    _copy(database, staging)
    os.replace(staging, target)
    return target


def restore_snapshot(database: Path, folder: Path) -> bool:
    """Put the newest snapshot in place of a missing local database; False when there is a database or no copy."""
    source = folder / SNAPSHOT_NAME
    if database.exists() or not source.is_file():
        return False
    database.parent.mkdir(parents=True, exist_ok=True)
    staging = database.with_name(f".{database.name}.restoring")
    staging.unlink(missing_ok=True)
    _copy(source, staging)
    os.replace(staging, database)
    log.warning("restored the panel's database from the snapshot in %s", folder)
    return True


def _copy(source: Path, target: Path) -> None:
    with sqlite3.connect(f"file:{source}?mode=ro", uri=True) as reading, sqlite3.connect(target) as writing:
        reading.backup(writing)
    reading.close()
    writing.close()


class Snapshots:
    """Writes a snapshot every `interval` seconds in a thread, and a last one on `stop`."""

    def __init__(self, database: Path, folder: Path, interval: float = INTERVAL_S):
        self.database, self.folder, self.interval = database, folder, interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="db-snapshots", daemon=True)

    def start(self) -> Snapshots:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=30)
        self._write()

    def _loop(self) -> None:
        while not self._stopped.wait(self.interval):
            self._write()

    def _write(self) -> None:
        try:
            write_snapshot(self.database, self.folder)
        except (OSError, sqlite3.Error) as error:  # a full or unmounted volume must not take the panel down
            log.error("could not write the database snapshot to %s: %s", self.folder, error)
