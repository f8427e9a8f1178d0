"""Jobs' stages: each unfinished job's row brought up to date from its launcher, and what still runs of an ended run
cancelled once it overruns its grace."""

from __future__ import annotations

import time
from typing import cast

from sqlmodel import col, select

from backend.context import PanelContext
from backend.database.models import Job, Run
from backend.launchers.base import TERMINAL


def update_jobs(ctx: PanelContext, run: Run) -> None:
    launcher = ctx.launcher_for(run)
    with ctx.db.session() as session:
        jobs = list(session.exec(select(Job).where(Job.run_id == run.id, col(Job.stage).not_in(TERMINAL))).all())
    for job in jobs:
        handle = ctx.handle(job)
        state = launcher.state(handle)
        tail = "\n".join(launcher.logs(handle, 20))
        with ctx.db.session() as session:
            row = cast(Job, session.get(Job, job.id))  # deleted mid-pass (with its run): fails the pass (poller.py)
            row.stage, row.message, row.log_tail = state.stage, state.message, tail
            row.started_at = state.started_at or row.started_at
            row.finished_at = state.finished_at if state.stage in TERMINAL else None
            session.add(row)
            session.commit()


def reap_jobs(ctx: PanelContext, run_id: str, status: str, stop_grace: float) -> None:
    """Cancel whatever still runs once a run has ended (the trainer normally stops its replicas itself)."""
    with ctx.db.session() as session:
        run = cast(Run, session.get(Run, run_id))  # a run deleted mid-pass fails the pass (poller.py)
        jobs = list(session.exec(select(Job).where(Job.run_id == run_id, col(Job.stage).not_in(TERMINAL))).all())
    since = run.stop_requested_at if status == "stopping" else run.finished_at
    if since is not None and time.time() - since < stop_grace:
        return  # the trainer is saving and exiting on its own (and stops its replicas); cancel only overruns
    launcher = ctx.launcher_for(run)
    for job in jobs:
        launcher.cancel(ctx.handle(job))
    if jobs:
        update_jobs(ctx, run)
