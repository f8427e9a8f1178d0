"""Launching a run as a recoverable state machine, persisted step by step in the `launch` table.

A launch starts the replicas, waits until they are healthy, publishes their URLs and starts the trainer
(`Launcher.launch`). On HF Jobs that takes minutes, and the panel may die at any point of it (a Space restarts on every
deploy) while replicas already bill. So:

- A launch is claimed atomically: the run moves from draft to launching in one compare-and-set, so two clicks, two
  browser tabs or two panels never launch a run twice.
- The panel driving a launch (its holder) records each step and renews its lease while it works.
- Every panel's poller looks for launches whose holder stopped renewing and takes one over with a compare-and-set on
  (holder, renewal time), so exactly one panel resumes it. The launcher then finds the run's jobs that are still alive
  on the backend itself (labels on HF Jobs, job folders locally), records the ones the dead panel had not, and goes
  on from the first step not done: no role gets a second job, and no job is left billing unseen.
- A launch that was asked to stop meanwhile, or that keeps being interrupted, is cleaned up instead: every job it
  started is cancelled and the run says why.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from secrets import token_hex
from typing import Any, cast

from sqlalchemy import CursorResult, Update, func, update
from sqlmodel import Session, col, select

from backend.context import PanelContext
from backend.database.models import Job, Launch, Run
from backend.ingestion.events import record_event
from backend.launchers.base import JobHandle, JobStart, LaunchError, LaunchInterrupted
from backend.services.costs import flavor_price_per_hour
from jobs.contract import RunSpec

log = logging.getLogger(__name__)
ENDED = ("done", "failed", "cancelled")


class Launches:
    """Claims, drives, and takes over launches on behalf of this panel process."""

    stale_after_s = 30.0  # a launch not renewed for this long is taken over by another panel
    max_takeovers = 3  # a launch interrupted more often than this is cleaned up, not resumed again

    def __init__(self, ctx: PanelContext, stale_after_s: float | None = None):
        self.ctx = ctx
        self.stale_after_s = stale_after_s or self.stale_after_s
        self.heartbeat_s = self.stale_after_s / 6  # several renewals fit in the window: one slow one is no takeover
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{token_hex(3)}"

    # --- starting -------------------------------------------------------------------------------------------------

    def claim(self, run_id: str, owner: str) -> bool:
        """Move the run from draft to launching and hold its launch; False if it was not a draft (any more)."""
        now = time.time()
        with self.ctx.db.session() as session:
            moved = _changed(
                session,
                update(Run)
                .where(col(Run.id) == run_id, col(Run.owner) == owner, col(Run.status) == "draft")
                .values(status="launching", started_at=now, status_message="starting the replicas"),
            )
            if not moved:
                return False
            session.add(Launch(run_id=run_id, owner=owner, holder=self.holder, renewed_at=now, updated_at=now))
            session.commit()
        return True

    def drive(self, run_id: str) -> None:
        """Run (or resume) a launch this panel holds, renewing the lease meanwhile; record how it ended."""
        with self.ctx.db.session() as session:
            run = session.get_one(Run, run_id)
        renewal = _Renewal(self, run_id)
        renewal.start()
        try:
            jobs = self.ctx.launcher_for(run).launch(
                self.ctx.spec(run),
                self.ctx.secrets_for(run),
                self.ctx.store_for(run),
                on_started=self._recorder(run),
                on_step=lambda step: self._step(run_id, step, renewal),
                on_progress=lambda starts: self._progress(run_id, starts),
            )
        except LaunchInterrupted:
            log.warning("the launch of %s was taken over by another panel; leaving it to that one", run_id)
            return
        except LaunchError as error:
            self._fail(run, f"{error}\n{error.log_tail}".strip(), str(error))
            return
        except Exception as error:
            log.exception("launching %s failed", run_id)
            self._fail(run, f"{type(error).__name__}: {error}", None)
            return
        finally:
            renewal.stop()
        with self.ctx.db.session() as session:
            for job in jobs:  # replicas' endpoints are known only once they are healthy
                row = session.exec(select(Job).where(Job.run_id == run_id, Job.backend_job_id == job.job_id)).first()
                if row is not None:
                    row.endpoint, row.url = job.endpoint, job.url
                    session.add(row)
            _end(session, run_id, "done", "")
            session.execute(
                update(Run)
                .where(col(Run.id) == run_id, col(Run.status) == "launching")
                .values(status_message="jobs started; the trainer is starting")
            )
            session.commit()

    def start(self, run_id: str, wait: bool) -> None:
        """Drive a claimed launch, in the background unless `wait` (the panel stays live meanwhile)."""
        if wait:
            self.drive(run_id)
        else:
            threading.Thread(target=self.drive, args=(run_id,), name=f"launch-{run_id}", daemon=True).start()

    # --- taking over ----------------------------------------------------------------------------------------------

    def recover(self) -> list[str]:
        """Take over every launch whose holder stopped renewing it; each is resumed or cleaned up in a thread."""
        stale_before = time.time() - self.stale_after_s
        with self.ctx.db.session() as session:
            stale = session.exec(
                select(Launch).where(
                    col(Launch.step).not_in(ENDED), col(Launch.renewed_at) < stale_before, Launch.holder != self.holder
                )
            ).all()
        taken = [launch.run_id for launch in stale if self._take_over(launch)]
        for run_id in taken:
            threading.Thread(target=self._resume, args=(run_id,), name=f"resume-{run_id}", daemon=True).start()
        return taken

    def _take_over(self, launch: Launch) -> bool:
        now = time.time()
        with self.ctx.db.session() as session:
            moved = _changed(
                session,
                update(Launch)
                .where(
                    col(Launch.run_id) == launch.run_id,
                    col(Launch.holder) == launch.holder,
                    col(Launch.renewed_at) == launch.renewed_at,
                )
                .values(holder=self.holder, renewed_at=now, updated_at=now, takeovers=col(Launch.takeovers) + 1),
            )
            session.commit()
        if moved:
            log.warning("took over the launch of %s (its panel stopped at step %r)", launch.run_id, launch.step)
        return bool(moved)

    def _resume(self, run_id: str) -> None:
        with self.ctx.db.session() as session:
            run, launch = session.get_one(Run, run_id), session.get_one(Launch, run_id)
        if run.status == "stopping":
            self._clean_up(run, "cancelled", "stopped", f"stopped while launching: {run.status_message}")
        elif launch.takeovers > self.max_takeovers:
            reason = f"the launch was interrupted {launch.takeovers} times (last at step {launch.step!r}); launch again"
            self._clean_up(run, "failed", "failed", reason)
        else:
            self._event(run, "launch_resumed", f"a panel restarted mid-launch (step {launch.step!r}); resuming", "info")
            self.drive(run_id)

    def _clean_up(self, run: Run, step: str, status: str, reason: str) -> None:
        """Cancel whatever the launch started (found on the backend, recorded or not) and end the run saying why."""
        launcher = self.ctx.launcher_for(run)
        jobs = launcher.find_jobs(self.ctx.spec(run))
        launcher.cancel_all(jobs)
        message = f"{reason}; cancelled {len(jobs)} job(s) it had started" if jobs else reason
        with self.ctx.db.session() as session:
            _end(session, run.id, step, message)
            session.execute(
                update(Run)
                .where(col(Run.id) == run.id)
                .values(status=status, status_message=message, finished_at=time.time())
            )
            session.commit()
        self._event(run, "launch_cleaned_up", message, "warning" if status == "stopped" else "error")

    # --- bookkeeping ----------------------------------------------------------------------------------------------

    def _step(self, run_id: str, step: str, renewal: _Renewal) -> None:
        """Record the step the launch begins; give the launch up if another panel holds it now."""
        now = time.time()
        with self.ctx.db.session() as session:
            held = _changed(
                session,
                update(Launch)
                .where(col(Launch.run_id) == run_id, col(Launch.holder) == self.holder, col(Launch.step).not_in(ENDED))
                .values(step=step, renewed_at=now, updated_at=now),
            )
            session.commit()
        if not held or renewal.lost:
            raise LaunchInterrupted(f"the launch of {run_id} is held by another panel")

    def _progress(self, run_id: str, starts: list[JobStart]) -> None:
        """Show where each job's start is (queued, starting, ready, and for how long) as the run's message."""
        text = "; ".join(str(start) for start in starts)
        with self.ctx.db.session() as session:
            session.execute(
                update(Run)
                .where(col(Run.id) == run_id, col(Run.status) == "launching")
                .values(status_message=f"waiting for the jobs: {text}"[:2000])
            )
            session.commit()

    def renew(self, run_id: str) -> bool:
        """Renew this panel's lease on the launch; False once another panel holds it (or it ended)."""
        with self.ctx.db.session() as session:
            held = _changed(
                session,
                update(Launch)
                .where(col(Launch.run_id) == run_id, col(Launch.holder) == self.holder, col(Launch.step).not_in(ENDED))
                .values(renewed_at=time.time()),
            )
            session.commit()
        return bool(held)

    def _recorder(self, run: Run) -> Callable[[JobHandle], None]:
        """Record each job of the launch once, whether this panel started it or found it started."""

        def record(job: JobHandle) -> None:
            with self.ctx.db.session(write_lock=True) as session:
                if session.exec(select(Job.id).where(Job.run_id == run.id, Job.backend_job_id == job.job_id)).first():
                    return
                attempts = session.exec(
                    select(func.max(Job.attempt)).where(Job.run_id == run.id, Job.role == job.role)
                ).first()
                session.add(job_row(self.ctx, run, job, (attempts or 0) + 1))
                session.commit()

        return record

    def _fail(self, run: Run, message: str, event: str | None) -> None:
        with self.ctx.db.session() as session:
            _end(session, run.id, "failed", message[:4000])
            session.execute(
                update(Run)
                .where(col(Run.id) == run.id)
                .values(status="failed", status_message=message[:4000], finished_at=time.time())
            )
            session.commit()
        if event is not None:
            self._event(run, "job_error", event, "error")

    def _event(self, run: Run, kind: str, message: str, level: str) -> None:
        record_event(self.ctx.db, run.id, run.owner, kind, message, level)


def job_row(ctx: PanelContext, run: Run, job: JobHandle, attempt: int) -> Job:
    """The database row of a job just started (or found) for `run`, with its flavor and price."""
    flavor = job_flavor(ctx.spec(run), job.role)
    return Job(
        run_id=run.id,
        owner=run.owner,
        role=job.role,
        attempt=attempt,
        backend_job_id=job.job_id,
        url=job.url,
        endpoint=job.endpoint,
        stage="scheduling",
        flavor=flavor,
        price_per_hour=flavor_price_per_hour(ctx, run, flavor) or 0.0,
    )


def job_flavor(spec: RunSpec, role: str) -> str:
    """The hardware a job runs on; local jobs run on this machine, whatever the spec's (HF Jobs) flavors say."""
    if spec.compute.backend == "local":
        return ""
    return spec.compute.trainer_flavor if role == "trainer" else spec.compute.replica_flavor


def _changed(session: Session, statement: Update) -> int:
    """Run an UPDATE; how many rows it changed (what a compare-and-set checks)."""
    result = cast("CursorResult[Any]", session.execute(statement))  # an UPDATE's result is a cursor's
    return result.rowcount


def _end(session: Session, run_id: str, step: str, message: str) -> None:
    session.execute(
        update(Launch).where(col(Launch.run_id) == run_id).values(step=step, message=message, updated_at=time.time())
    )


class _Renewal:
    """Renews a launch's lease from a thread of its own (a launch waits minutes inside single calls)."""

    def __init__(self, launches: Launches, run_id: str):
        self.launches, self.run_id = launches, run_id
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{run_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.launches.heartbeat_s):
            try:
                if not self.launches.renew(self.run_id):
                    self.lost = True
                    return
            except Exception:  # a failed renewal is tried again; the lease only lapses if renewals keep failing
                log.exception("renewing the launch lease of %s failed", self.run_id)
