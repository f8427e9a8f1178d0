"""What a run's jobs report as they run: their telemetry streams, ingested exactly once, and their status files.

A telemetry stream is listed after the last chunk ingested, and each chunk's rows are committed in the same transaction
as the cursor that moves past it, moved by compare-and-set (backend/database/cursors.py): a poller killed at any
moment resumes where it stopped, and two pollers never ingest a chunk twice.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence

from sqlalchemy.dialects.sqlite import insert
from sqlmodel import Session

from backend.database import cursors
from backend.database.connection import Database
from backend.database.models import ReplicaStatus, Run
from backend.ingestion import ingest
from backend.ingestion.records import JsonRecord, StatusRecord
from jobs.contract import layout
from jobs.contract.layout import TelemetryStream
from jobs.store import ObjectStore, StoreError
from jobs.telemetry import decode_jsonl

# One stream's ingest function (backend/ingestion/ingest.py): the records of one chunk into the caller's transaction.
Ingester = Callable[[Session, str, str, Sequence[JsonRecord]], int]
# Looked up for each chunk (a test swaps an entry); the proxy's stream, JSON snapshots, is ingested apart.
STREAM_INGESTERS: dict[TelemetryStream, Ingester] = {
    "metrics": ingest.ingest_metrics,
    "samples": ingest.ingest_samples,
    "events": ingest.ingest_events,
    "eval": ingest.ingest_eval,
}


def ingest_stream(
    db: Database,
    run: Run,
    store: ObjectStore,
    stream: TelemetryStream,
    chunks_per_pass: int,
) -> int:
    """Ingest up to `chunks_per_pass` new chunks of `stream` (the proxy's as JSON snapshots, the others as JSONL
    through `STREAM_INGESTERS`); returns how many this poller ingested."""
    expected = cursors.read(db, run.id, stream)
    chunks = list(
        store.list(layout.telemetry_prefix(run.id, stream), start_after=expected or None, limit=chunks_per_pass)
    )
    for ingested, info in enumerate(chunks):
        data = store.get_bytes(info.key)
        with db.session() as session:
            if not cursors.advance(session, run.id, stream, expected, info.key):
                return ingested  # another poller took this chunk; the next pass lists after where it got to
            if stream == "proxy":
                ingest.ingest_proxy(session, run.id, run.owner, json.loads(data))
            else:
                STREAM_INGESTERS[stream](session, run.id, run.owner, decode_jsonl(data))
            session.commit()  # rows and cursor together: exactly once
        expected = info.key
    return len(chunks)


def ingest_status(db: Database, run: Run, store: ObjectStore) -> StatusRecord | None:
    """Keep each job's status file as its role's heartbeat row; returns the trainer's, if it has one that reads."""
    trainer: StatusRecord | None = None
    for info in store.list(layout.status_prefix(run.id)):
        role = info.key.rsplit("/", 1)[-1].removesuffix(".json")
        try:
            body: StatusRecord = json.loads(store.get_bytes(info.key))
        except (StoreError, ValueError):
            continue
        if role == "trainer":
            trainer = body
        heartbeat = {"time": float(body.get("time") or time.time()), "data_json": json.dumps(body)}
        with db.session() as session:
            session.execute(
                insert(ReplicaStatus)
                .values(run_id=run.id, owner=run.owner, role=role, **heartbeat)
                .on_conflict_do_update(index_elements=[ReplicaStatus.run_id, ReplicaStatus.role], set_=heartbeat)
            )
            session.commit()
    return trainer
