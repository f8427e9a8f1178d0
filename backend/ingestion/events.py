"""A run's history: notable happenings (launch steps, stops, relaunches, failures) recorded as `Event` rows."""

from __future__ import annotations

import time

from backend.database.connection import Database
from backend.database.models import Event, Run


def record_event(db: Database, run_id: str, owner: str, kind: str, message: str, level: str) -> None:
    """Add one event, at the run's step; an error stays active (shown as a banner) until dismissed or cleared by a
    later success."""
    with db.session() as session:
        run = session.get(Run, run_id)
        session.add(
            Event(
                run_id=run_id,
                owner=owner,
                time=time.time(),
                level=level,
                kind=kind,
                message=message[:4000],
                active=level == "error",
                step=run.step if run is not None else None,
            )
        )
        session.commit()
