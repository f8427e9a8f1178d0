"""Stream cursors: where ingestion of each of a run's store streams stopped, moved by compare-and-set.

Several pollers may read the same data folder at once (the panel's own poller thread, `python -m backend follow` or
`demo` in a terminal, a second panel process). Each reads a cursor, ingests the next chunk and moves the cursor past
it; if two did that unchecked, both would ingest the chunk. `advance` moves a cursor only from the value its caller
read, and it is the first statement of the caller's transaction: SQLite takes the write lock for it, so the rows the
caller then inserts commit together with the cursor move or not at all, and a poller that lost the race ingests
nothing (it lists again from wherever the winner got to).
"""

from __future__ import annotations

import time
from typing import Any, cast

from sqlalchemy import CursorResult
from sqlalchemy.dialects.sqlite import insert
from sqlmodel import Session, col

from backend.database.connection import Database
from backend.database.models import PollCursor


def read(db: Database, run_id: str, stream: str) -> str:
    """The last store key of `stream` ingested for the run ("" before the first)."""
    with db.session() as session:
        cursor = session.get(PollCursor, (run_id, stream))
    return cursor.cursor if cursor is not None else ""


def advance(session: Session, run_id: str, stream: str, expected: str, to: str) -> bool:
    """Move the cursor from `expected` to `to` in the session's transaction; False if it is no longer `expected`.

    Call it before anything else the transaction writes, and commit the ingested rows in the same transaction.
    """
    now = time.time()
    statement = (
        insert(PollCursor)
        .values(run_id=run_id, stream=stream, cursor=to, updated_at=now)
        .on_conflict_do_update(
            index_elements=[PollCursor.run_id, PollCursor.stream],
            set_={"cursor": to, "updated_at": now},
            where=col(PollCursor.cursor) == expected,
        )
    )
    result = cast("CursorResult[Any]", session.execute(statement))  # an INSERT's: it counts the rows written
    return result.rowcount == 1
