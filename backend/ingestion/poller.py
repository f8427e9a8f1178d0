"""The poller: brings everything a run writes to its store, and every job's stage, into SQLite.

Exactly once: a stream is listed after the last key ingested, and each chunk's rows are committed in the same
transaction as the cursor that moves past it, moved by compare-and-set (`backend.database.cursors`), so a panel
killed at any moment resumes where it stopped, and several pollers on one data folder (the panel, `backend follow`, a
second panel) never ingest a chunk twice. Every run is polled independently; a store or Hub error on one run backs
off that run only, and the loop itself survives any failed iteration. Each pass also takes over launches whose panel
died mid-launch (backend/services/launches.py).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from sqlalchemy import func
from sqlalchemy.dialects.sqlite import insert
from sqlmodel import Session, select

from backend.context import PanelContext
from backend.database import cursors
from backend.database.models import AdapterVersion, Job, MetricPoint, ReplicaStatus, Run
from backend.ingestion import alerts, ingest
from backend.launchers.base import TERMINAL
from backend.services.launches import Launches
from backend.services.runs import RunService
from jobs.contract import layout
from jobs.store import ObjectStore, StoreError, VersionNotPublished, read_manifest
from jobs.telemetry import decode_jsonl

log = logging.getLogger(__name__)
ACTIVE = ("launching", "running", "degraded", "stalled", "finalizing", "stopping")
TERMINAL_PHASES = ("finished", "failed", "stopped")
STREAM_INGESTERS = {
    "metrics": ingest.ingest_metrics,
    "samples": ingest.ingest_samples,
    "events": ingest.ingest_events,
    "eval": ingest.ingest_eval,
}


class Poller:
    def __init__(
        self,
        ctx: PanelContext,
        interval: float = 2.0,
        stall_after: float = 300.0,
        chunks_per_pass: int = 200,
        stop_grace: float = 120.0,
        launches: Launches | None = None,
    ):
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
            active = set(session.exec(select(Run.id).where(Run.status.in_(ACTIVE))).all())
            # An ended run whose jobs still run is polled too, until they are reaped: nothing keeps billing.
            active |= set(session.exec(select(Job.run_id).where(Job.stage.not_in(TERMINAL))).all())
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
        store = self.ctx.store_for(run)
        # Jobs first: a trainer writes its last status and telemetry before its job ends, so everything read from the
        # store after a job is seen ended already holds what that job wrote. Read the other way round, a trainer that
        # finished between the two reads looks like a job that ended without a final phase (a failed run).
        self._update_jobs(run)
        chunks = sum(self._ingest_stream(run, store, stream) for stream in (*STREAM_INGESTERS, "proxy"))
        arrived = chunks > 0
        self._ingest_versions(run, store)
        self._ingest_current(run, store)
        self._ingest_audits(run, store)
        trainer = self._ingest_status(run, store)
        self._derive_status(run_id, trainer, arrived)
        alerts.evaluate(self.ctx.db, run_id)
        return chunks

    def _ingest_stream(self, run: Run, store: ObjectStore, stream: str) -> int:
        expected = cursors.read(self.ctx.db, run.id, stream)
        chunks = list(
            store.list(
                layout.telemetry_prefix(run.id, stream), start_after=expected or None, limit=self.chunks_per_pass
            )
        )
        for ingested, info in enumerate(chunks):
            data = store.get_bytes(info.key)
            with self.ctx.db.session() as session:
                if not cursors.advance(session, run.id, stream, expected, info.key):
                    return ingested  # another poller took this chunk; the next pass lists after where it got to
                if stream == "proxy":
                    ingest.ingest_proxy(session, run.id, run.owner, json.loads(data))
                else:
                    STREAM_INGESTERS[stream](session, run.id, run.owner, decode_jsonl(data))
                session.commit()  # rows and cursor together: exactly once
            expected = info.key
        return len(chunks)

    def _ingest_versions(self, run: Run, store: ObjectStore) -> None:
        prefix = layout.adapters_prefix(run.id)
        expected = cursors.read(self.ctx.db, run.id, "adapters")
        for info in store.list(prefix, start_after=expected or None):
            version = _manifest_version(info.key[len(prefix) :])
            if version is None:
                continue
            try:
                manifest = read_manifest(store, layout.adapter_prefix(run.id, version))
            except VersionNotPublished:
                continue
            with self.ctx.db.session() as session:
                if not cursors.advance(session, run.id, "adapters", expected, info.key):
                    return
                session.execute(
                    insert(AdapterVersion)
                    .values(
                        run_id=run.id,
                        owner=run.owner,
                        version=version,
                        step=manifest.meta.get("step"),
                        created_at=manifest.created,
                        size_bytes=manifest.total_size,
                        manifest_json=manifest.to_json().decode(),
                        attempt=manifest.meta.get("attempt"),
                        reward=ingest.version_reward(session, run.id, manifest.meta.get("step")),
                    )
                    .on_conflict_do_nothing()  # republished after a crash: the version is already listed
                )
                session.commit()
            expected = info.key

    def _ingest_current(self, run: Run, store: ObjectStore) -> None:
        try:
            current = int(store.get_bytes(layout.current_key(run.id)).decode().strip())
        except (StoreError, ValueError):
            return
        with self.ctx.db.session() as session:
            row = session.get(Run, run.id)
            if row.current_version != current:
                row.current_version = current
                session.add(row)
                session.commit()

    def _ingest_audits(self, run: Run, store: ObjectStore) -> None:
        expected = cursors.read(self.ctx.db, run.id, "audit")
        for info in store.list(layout.audit_prefix(run.id), start_after=expected or None):
            record = json.loads(store.get_bytes(info.key))
            diffs = [r.get("max_abs_diff") for r in record.get("replicas", {}).values()]
            worst = max((d for d in diffs if d is not None), default=None)
            with self.ctx.db.session() as session:
                if not cursors.advance(session, run.id, "audit", expected, info.key):
                    return
                version = session.exec(
                    select(AdapterVersion).where(
                        AdapterVersion.run_id == run.id, AdapterVersion.version == record.get("version")
                    )
                ).first()
                if version is None:
                    return  # the manifest is not ingested yet; read this audit on the next pass (nothing committed)
                version.audit_max_diff, version.audit_ok = worst, bool(record.get("ok"))
                session.add(version)
                session.commit()
            expected = info.key

    def _ingest_status(self, run: Run, store: ObjectStore) -> dict[str, Any] | None:
        trainer = None
        for info in store.list(layout.status_prefix(run.id)):
            role = info.key.rsplit("/", 1)[-1].removesuffix(".json")
            try:
                body = json.loads(store.get_bytes(info.key))
            except (StoreError, ValueError):
                continue
            if role == "trainer":
                trainer = body
            heartbeat = {"time": float(body.get("time") or time.time()), "data_json": json.dumps(body)}
            with self.ctx.db.session() as session:
                session.execute(
                    insert(ReplicaStatus)
                    .values(run_id=run.id, owner=run.owner, role=role, **heartbeat)
                    .on_conflict_do_update(index_elements=[ReplicaStatus.run_id, ReplicaStatus.role], set_=heartbeat)
                )
                session.commit()
        return trainer

    def _update_jobs(self, run: Run) -> None:
        launcher = self.ctx.launcher_for(run)
        with self.ctx.db.session() as session:
            jobs = list(session.exec(select(Job).where(Job.run_id == run.id, Job.stage.not_in(TERMINAL))).all())
        for job in jobs:
            handle = self.ctx.handle(job)
            state = launcher.state(handle)
            tail = "\n".join(launcher.logs(handle, 20))
            with self.ctx.db.session() as session:
                row = session.get(Job, job.id)
                row.stage, row.message, row.log_tail = state.stage, state.message, tail
                row.started_at = state.started_at or row.started_at
                row.finished_at = state.finished_at if state.stage in TERMINAL else None
                session.add(row)
                session.commit()

    def _derive_status(self, run_id: str, trainer: dict[str, Any] | None, arrived: bool) -> None:
        now = time.time()
        # Locked: a stop from the panel (or another poller's verdict) between reading the run and writing it back
        # would otherwise be overwritten.
        with self.ctx.db.session(write_lock=True) as session:
            run = session.get(Run, run_id)
            jobs = list(session.exec(select(Job).where(Job.run_id == run_id)).all())
            latest_step = session.exec(select(func.max(MetricPoint.step)).where(MetricPoint.run_id == run_id)).first()
            reward = session.exec(
                select(MetricPoint.value)
                .where(MetricPoint.run_id == run_id, MetricPoint.name == "reward")
                .order_by(MetricPoint.step.desc())
            ).first()
            if arrived:
                run.last_telemetry_at = now
            run.step = int(latest_step or run.step or 0)
            run.latest_reward = reward if reward is not None else run.latest_reward
            run.cost_usd = sum(_job_cost(job, now) for job in jobs)
            phase = (trainer or {}).get("phase")
            latest = {}  # the newest attempt of each role: a replaced replica's old job no longer counts
            for job in sorted(jobs, key=lambda j: j.attempt):
                latest[job.role] = job
            trainer_job = latest.get("trainer")
            replica_jobs = [j for role, j in latest.items() if role.startswith("replica-")]
            status, message = run.status, run.status_message
            if run.status in TERMINAL_PHASES:
                pass  # an ended run stays ended (a relaunch sets it running again explicitly)
            elif phase in TERMINAL_PHASES:
                status = phase
                message = (
                    ((trainer or {}).get("last_error") or "")
                    if phase == "failed"
                    else f"{phase} at step {(trainer or {}).get('step', run.step)}"  # telemetry may still be behind
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
                stalled = run.last_telemetry_at is not None and now - run.last_telemetry_at > self.stall_after
                status = "stalled" if stalled else ("degraded" if _proxy_degraded(session, run_id) else "running")
                message = f"no telemetry for {now - run.last_telemetry_at:.0f}s" if stalled else ""
            elif phase in ("starting", "waiting_replicas"):
                status = "launching"
            run.status, run.status_message = status, message
            if status in TERMINAL_PHASES and run.finished_at is None:
                run.finished_at = now
            session.add(run)
            session.commit()
        if status in ACTIVE and status != "stopping":
            self._enforce_cost_cap(run_id)
        if status in TERMINAL_PHASES or status == "stopping":
            self._reap_jobs(run_id, status)

    def _enforce_cost_cap(self, run_id: str) -> None:
        """Stop a run gracefully once it has cost what its owner allowed (`compute.cost_cap_usd`)."""
        with self.ctx.db.session() as session:
            run = session.get(Run, run_id)
        if run.cost_usd <= 0:  # local runs, and the first minutes of any run: nothing to compare yet
            return
        cap = self.ctx.spec(run).compute.cost_cap_usd
        if cap is not None and run.cost_usd >= cap:
            reason = f"cost cap reached: ${run.cost_usd:.2f} of ${cap:.2f}"
            RunService(self.ctx, run.owner).stop(run_id, reason, kind="cost_cap", level="warning")

    def _reap_jobs(self, run_id: str, status: str) -> None:
        """Cancel whatever still runs once a run has ended (the trainer normally stops its replicas itself)."""
        with self.ctx.db.session() as session:
            run = session.get(Run, run_id)
            jobs = list(session.exec(select(Job).where(Job.run_id == run_id, Job.stage.not_in(TERMINAL))).all())
        since = run.stop_requested_at if status == "stopping" else run.finished_at
        if since is not None and time.time() - since < self.stop_grace:
            return  # the trainer is saving and exiting on its own (and stops its replicas); cancel only overruns
        launcher = self.ctx.launcher_for(run)
        for job in jobs:
            launcher.cancel(self.ctx.handle(job))
        if jobs:
            self._update_jobs(run)


def _manifest_version(rest: str) -> int | None:
    """The version whose manifest `rest` (a key below the run's adapters/ prefix) is, else None."""
    if not rest.endswith("/" + layout.MANIFEST):
        return None
    return layout.parse_version_dir(rest.split("/")[0])


def _job_cost(job: Job, now: float) -> float:
    if not job.price_per_hour or job.started_at is None:
        return 0.0
    end = job.finished_at or now
    return max(0.0, end - job.started_at) / 3600 * job.price_per_hour


def _proxy_degraded(session: Session, run_id: str) -> bool:
    latest = ingest.latest_proxy_snapshots(session, run_id)
    replicas = (latest[0].get("replicas") or []) if latest else []
    return any(not r.get("healthy", True) for r in replicas)  # an ejected replica is not healthy (proxy/upstreams.py)
