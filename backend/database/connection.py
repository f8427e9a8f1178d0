"""The panel's SQLite database: where it lives, how it is opened.

WAL mode lets the poller write while pages read; a busy timeout absorbs the brief write locks instead of failing.
Opening it brings its tables up to date (backend/database/schema.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.pool import ConnectionPoolEntry
from sqlmodel import Session, create_engine

from backend import settings
from backend.database import schema

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def data_dir() -> Path:
    """The panel's data folder: $GRPO_PANEL_DATA, else `data/` in the project."""
    folder = Path(settings.DATA.get() or PROJECT_ROOT / "data")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def default_db_path() -> Path:
    return data_dir() / "panel.sqlite3"


class Database:
    def __init__(self, path: str | os.PathLike[str] | None = None):
        self.path = Path(path) if path is not None else default_db_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.engine: Engine = create_engine(
            f"sqlite:///{self.path}", connect_args={"check_same_thread": False, "timeout": 30}
        )
        event.listen(self.engine, "connect", _configure_connection)
        schema.upgrade(self.engine, self.path.with_name(self.path.name + ".migrating"))

    @contextmanager
    def session(self, write_lock: bool = False) -> Iterator[Session]:
        """A session; with `write_lock`, its transaction takes SQLite's write lock before its first statement.

        Without it a transaction begins at its first write (SQLite's deferred mode), so what it read before may have
        changed by then. Take the lock when the session reads, decides and writes, and another process (a second
        poller) may do the same at once: the other then waits for this one's commit and reads its result.
        """
        with Session(self.engine, expire_on_commit=False) as session:
            if write_lock:
                session.connection().exec_driver_sql("BEGIN IMMEDIATE")
            yield session

    def close(self) -> None:
        self.engine.dispose()


def _configure_connection(connection: DBAPIConnection, _record: ConnectionPoolEntry) -> None:
    cursor = connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()
