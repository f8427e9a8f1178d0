"""A run's status, derived after every pass from its jobs' stages, its trainer's status file and its telemetry, with
its step, latest reward and cost."""

from __future__ import annotations

import time
from typing import cast

from sqlalchemy import func
from sqlmodel import Session, col, select

from backend.database.connection import Database
from backend.database.models import TERMINAL_STATUSES, Job, MetricPoint, Run
from backend.ingestion import ingest
from backend.ingestion.cost_cap import job_cost
from backend.ingestion.records import StatusRecord
from backend.launchers.base import TERMINAL

ACTIVE = ("launching", "running", "degraded", "stalled", "finalizing", "stopping")


def derive_status(db: Database, run_id: str, trainer: StatusRecord | None, arrived: bool, stall_after: float) -> str:
    """Write the run's status (and step, reward, cost) as its jobs and trainer say now; returns the status."""
    now = time.time()
    # Locked: a stop from the panel (or another poller's verdict) between reading the run and writing it back
    # would otherwise be overwritten.
    with db.session(write_lock=True) as session:
        run = cast(Run, session.get(Run, run_id))  # a run deleted mid-pass fails the pass (poller.py)
        jobs = list(session.exec(select(Job).where(Job.run_id == run_id)).all())
        latest_step = session.exec(select(func.max(MetricPoint.step)).where(MetricPoint.run_id == run_id)).first()
        reward = session.exec(
            select(MetricPoint.value)
            .where(MetricPoint.run_id == run_id, MetricPoint.name == "reward")
            .order_by(col(MetricPoint.step).desc())
        ).first()
        if arrived:
            run.last_telemetry_at = now
        run.step = int(latest_step or run.step or 0)
        run.latest_reward = reward if reward is not None else run.latest_reward
        run.cost_usd = sum(job_cost(job, now) for job in jobs)
        status, message = _verdict(session, run, trainer or {}, jobs, now, stall_after)
        run.status, run.status_message = status, message
        if status in TERMINAL_STATUSES and run.finished_at is None:
            run.finished_at = now
        session.add(run)
        session.commit()
    return status


def _verdict(
    session: Session, run: Run, trainer: StatusRecord, jobs: list[Job], now: float, stall_after: float
) -> tuple[str, str]:
    """The run's status and message: its trainer's phase, unless a job ended first or telemetry stopped arriving."""
    phase = trainer.get("phase")
    latest: dict[str, Job] = {}  # the newest attempt of each role: a replaced replica's old job no longer counts
    for job in sorted(jobs, key=lambda j: j.attempt):
        latest[job.role] = job
    trainer_job = latest.get("trainer")
    replica_jobs = [j for role, j in latest.items() if role.startswith("replica-")]
    status, message = run.status, run.status_message
    if run.status in TERMINAL_STATUSES:
        pass  # an ended run stays ended (a relaunch sets it running again explicitly)
    elif phase in TERMINAL_STATUSES:  # the trainer's phase that ends a run becomes the run's status
        status = phase
        message = (
            (trainer.get("last_error") or "")
            if phase == "failed"
            else f"{phase} at step {trainer.get('step', run.step)}"  # telemetry may still be behind
        )
    elif trainer_job is not None and trainer_job.stage in TERMINAL:
        status = "failed" if run.status != "stopping" else "stopped"
        last = trainer_job.log_tail.strip().splitlines()[-1:] or [""]
        message = f"the trainer job ended ({trainer_job.stage}: {trainer_job.message}) {last[0]}"[:2000]
    elif run.status == "stopping":
        pass  # the trainer is wrapping up and stops its replicas itself
    elif phase == "saving":  # between the last step and the end: say so rather than "running" at 100 %
        status, message = "finalizing", "training done: publishing the final adapter, stopping the replicas"
    elif phase == "evaluating":
        status, message = "finalizing", "training done: scoring the last version on the held-out prompts"
    elif any(j.stage in ("error", "canceled", "completed") for j in replica_jobs):
        status = "degraded"
        message = "a replica job ended; training continues on the others"
    elif phase == "training":
        silent = None if run.last_telemetry_at is None else now - run.last_telemetry_at
        if silent is not None and silent > stall_after:
            status, message = "stalled", f"no telemetry for {silent:.0f}s"
        else:
            status, message = ("degraded" if _proxy_degraded(session, run.id) else "running"), ""
    elif phase in ("starting", "waiting_replicas"):
        status = "launching"
    return status, message


def _proxy_degraded(session: Session, run_id: str) -> bool:
    latest = ingest.latest_proxy_snapshot(session, run_id)
    replicas = (latest.get("replicas") or []) if latest is not None else []
    return any(not r.get("healthy", True) for r in replicas)  # an ejected replica is not healthy (proxy/upstreams.py)
