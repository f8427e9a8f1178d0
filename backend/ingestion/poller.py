"""The poller: brings everything a run writes to its store, and every job's stage, into SQLite.

Exactly once: a stream is listed after the last key ingested, and each chunk's rows are committed in the same
transaction as the cursor that moves past it, moved by compare-and-set (`backend.database.cursors`), so a panel
killed at any moment resumes where it stopped, and several pollers on one data folder (the panel, `backend follow`, a
second panel) never ingest a chunk twice. Every run is polled independently; a store or Hub error on one run backs
off that run only (a run deleted mid-pass too: its row reads as None and the pass fails), and the loop itself survives
any failed iteration. Each pass also takes over launches whose panel died mid-launch (backend/services/launches.py).

This module holds the loop and one pass over a run, in order; the steps of a pass live beside it:
- job_stages.py: each job's stage from its launcher, and cancelling what still runs of an ended run;
- streams.py: the telemetry streams (through its `STREAM_INGESTERS`, ingest.py's functions) and the status files;
- versions.py: adapter versions (their manifests), the `current` pointer, and the policy audits;
- run_status.py: the run's status, step, reward and cost, derived from all of that; cost_cap.py: the cost cap;
- alerts.py: the alerts and the `best` version, re-evaluated last.
records.py gives the JSON that jobs write its shapes.
"""

from __future__ import annotations

import logging
import threading
import time

from sqlmodel import col, select

from backend.context import PanelContext
from backend.database.models import TERMINAL_STATUSES, Job, Run
from backend.ingestion import alerts
from backend.ingestion.cost_cap import enforce_cost_cap
from backend.ingestion.job_stages import reap_jobs, update_jobs
from backend.ingestion.run_status import ACTIVE, derive_status
from backend.ingestion.streams import STREAM_INGESTERS, ingest_status, ingest_stream
from backend.ingestion.versions import ingest_audits, ingest_current, ingest_versions
from backend.launchers.base import TERMINAL
from backend.services.launches import Launches
from jobs.contract.layout import TelemetryStream

log = logging.getLogger(__name__)


class Poller:
    def __init__(
        self,
        ctx: PanelContext,
        interval: float = 2.0,
        stall_after: float = 300.0,
        chunks_per_pass: int = 200,
        stop_grace: float = 120.0,
        launches: Launches | None = None,
    ) -> None:
        self.ctx, self.interval, self.stall_after = ctx, interval, stall_after
        self.chunks_per_pass, self.stop_grace = chunks_per_pass, stop_grace
        self.launches = launches or Launches(ctx)
        self._backoff: dict[str, tuple[float, float]] = {}  # run id -> (retry at, current delay)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- the loop -----------------------------------------------------------------------------------------------

    def start(self) -> Poller:
        self._thread = threading.Thread(target=self._loop, name="poller", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception:
                log.exception("poller pass failed")
            self._stop.wait(self.interval)

    def poll_once(self) -> None:
        try:
            self.launches.recover()
        except Exception:
            log.exception("recovering interrupted launches failed")
        with self.ctx.db.session() as session:
            active = set(session.exec(select(Run.id).where(col(Run.status).in_(ACTIVE))).all())
            # An ended run whose jobs still run is polled too, until they are reaped: nothing keeps billing.
            active |= set(session.exec(select(Job.run_id).where(col(Job.stage).not_in(TERMINAL))).all())
        run_ids = sorted(active)
        now = time.monotonic()
        for run_id in run_ids:
            retry_at, delay = self._backoff.get(run_id, (0.0, 0.0))
            if now < retry_at:
                continue
            try:
                self.poll_run(run_id)
                self._backoff.pop(run_id, None)
            except Exception as error:
                delay = min(60.0, max(2.0, delay * 2))
                self._backoff[run_id] = (time.monotonic() + delay, delay)
                log.warning("polling %s failed (%s); retrying in %.0fs", run_id, error, delay)

    # --- one run --------------------------------------------------------------------------------------------------

    def poll_run(self, run_id: str) -> int:
        """One pass over one run; returns how many telemetry chunks it ingested."""
        with self.ctx.db.session() as session:
            run = session.get(Run, run_id)
        if run is None:
            return 0
        db, store = self.ctx.db, self.ctx.store_for(run)
        # Jobs first: a trainer writes its last status and telemetry before its job ends, so everything read from the
        # store after a job is seen ended already holds what that job wrote. Read the other way round, a trainer that
        # finished between the two reads looks like a job that ended without a final phase (a failed run).
        update_jobs(self.ctx, run)
        streams: tuple[TelemetryStream, ...] = (*STREAM_INGESTERS, "proxy")
        chunks = sum(ingest_stream(db, run, store, s, self.chunks_per_pass) for s in streams)
        arrived = chunks > 0
        ingest_versions(db, run, store)
        ingest_current(db, run, store)
        ingest_audits(db, run, store)
        trainer = ingest_status(db, run, store)
        status = derive_status(db, run_id, trainer, arrived, self.stall_after)
        if status in ACTIVE and status != "stopping":
            enforce_cost_cap(self.ctx, run_id)
        if status in TERMINAL_STATUSES or status == "stopping":
            reap_jobs(self.ctx, run_id, status, self.stop_grace)
        alerts.evaluate(db, run_id)
        return chunks
