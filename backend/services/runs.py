"""Run services: create, launch, stop, list, get and delete runs — always on behalf of one owner.

Every method takes the owner at construction and never reads or changes another owner's run: a run id that belongs
to someone else is reported exactly like one that does not exist.
"""

from __future__ import annotations

import builtins
import logging
import time
from typing import Any

from sqlalchemy import delete
from sqlmodel import col, select

from backend.context import PanelContext
from backend.database.models import (
    TERMINAL_STATUSES,
    AdapterVersion,
    Event,
    Job,
    Launch,
    MetricPoint,
    PollCursor,
    ProxySnapshot,
    ReplicaStatus,
    ResumePoint,
    RolloutSample,
    Run,
    VersionScore,
)
from backend.hosting import on_space
from backend.ingestion.events import record_event
from backend.launchers.base import JobHandle
from backend.services.launches import Launches, job_row
from jobs.contract import RunSpec, layout
from jobs.contract.control import JOBS, STOP, UPSTREAMS, JobsRecord, StopRequest, Upstream, UpstreamsRecord
from jobs.store import ObjectStore, S3Store

log = logging.getLogger(__name__)


def run_id_taken(ctx: PanelContext, run_id: str) -> bool:
    """Whether any run has this id (of any owner: an id names the run's folder in a bucket and its row here)."""
    with ctx.db.session() as session:
        return session.get(Run, run_id) is not None


def propose_run_id(ctx: PanelContext, prefix: str) -> str:
    """A free run id, `<prefix>-MMDD-HHMMSS`, with `-2`, `-3`, ... when that second's id is taken."""
    base = f"{prefix}-{time.strftime('%m%d-%H%M%S')}".lower()
    proposal, number = base, 1
    while run_id_taken(ctx, proposal):
        number += 1
        proposal = f"{base}-{number}"
    return proposal


class RunNotFound(LookupError):
    pass


class RunStateError(RuntimeError):
    pass


class RunService:
    def __init__(self, ctx: PanelContext, owner: str):
        self.ctx, self.owner = ctx, owner

    # --- reading ------------------------------------------------------------------------------------------------

    def get(self, run_id: str) -> Run:
        with self.ctx.db.session() as session:
            run = session.get(Run, run_id)
        if run is None or run.owner != self.owner:
            raise RunNotFound(f"no run {run_id!r}")
        return run

    def list(self) -> list[Run]:
        with self.ctx.db.session() as session:
            newest_first = col(Run.created_at).desc()
            return list(session.exec(select(Run).where(Run.owner == self.owner).order_by(newest_first)).all())

    def jobs(self, run_id: str) -> builtins.list[Job]:  # `list` is a method here
        self.get(run_id)
        with self.ctx.db.session() as session:
            return list(session.exec(select(Job).where(Job.run_id == run_id).order_by(Job.role)).all())

    # --- creating and launching -----------------------------------------------------------------------------------

    def create(
        self,
        spec: RunSpec,
        store_credential_id: int | None = None,
        hf_credential_id: int | None = None,
        wandb_credential_id: int | None = None,
    ) -> Run:
        """Record a run and write its spec to its store. Validation of everything else happens in preflight."""
        if run_id_taken(self.ctx, spec.run_id):
            raise RunStateError(f"run_id: {spec.run_id!r} is taken; choose another run id")
        for credential_id in (store_credential_id, hf_credential_id, wandb_credential_id):
            if credential_id is not None:
                self.ctx.vault.get(self.owner, credential_id)  # raises unless this owner holds it
        if spec.parent is not None:
            self.get(spec.parent.run_id)  # a branch starts from the parent's adapter: only of one's own run
        check_hosting(spec)
        run = run_row(spec, self.owner, "draft", store_credential_id, hf_credential_id, wandb_credential_id)
        store = self.ctx.store_for(run)
        spec = with_bucket_region(spec, store)
        run.spec_json = spec.to_json()
        store.put_bytes(layout.spec_key(spec.run_id), spec.to_json().encode())
        with self.ctx.db.session() as session:
            session.add(run)
            session.commit()
        return run

    def launch(self, run_id: str, wait: bool = False) -> Run:
        """Start the run's jobs. With `wait=False` the launch proceeds in the background (the panel stays live).

        Only a draft can be launched, and only once: the move to `launching` is atomic, so a second click (or a
        second panel) is refused. The launch survives the panel: see backend/services/launches.py.
        """
        run = self.get(run_id)
        active = [other.id for other in self.list() if other.status not in (*TERMINAL_STATUSES, "draft")]
        self.ctx.limits.check_runs(self.owner, active)
        launches = Launches(self.ctx)
        if not launches.claim(run_id, self.owner):
            raise RunStateError(f"run {run_id} is {self.get(run_id).status}; only a new run can be launched")
        launches.start(run.id, wait)
        return self.get(run_id)

    def relaunch_trainer(self, run_id: str) -> Job:
        """Start a new trainer attempt (after a crash or preemption); it resumes from the newest stored checkpoint."""
        run = self.get(run_id)
        if run.status in ("draft", "stopping"):
            raise RunStateError(f"run {run_id} is {run.status}; a trainer can be relaunched only once it has run")
        job, _ = self._start_attempt(run, "trainer")
        self._set(run_id, status="running", finished_at=None, status_message="trainer relaunched; resuming")
        self._event(run_id, "relaunch", f"trainer relaunched (attempt {job.attempt})", "info")
        return job

    def replace_replica(self, run_id: str, role: str) -> Job:
        """Start a fresh job for a replica that died and point the proxy at it.

        The proxy watches `control/upstreams.json` and re-admits the replica only after loading every live adapter
        version onto it, so it never serves a policy it does not hold.
        """
        run = self.get(run_id)
        if run.status not in ("running", "degraded", "stalled"):
            raise RunStateError(f"run {run_id} is {run.status}; replicas can be replaced only while it trains")
        spec = self.ctx.spec(run)
        if not role.startswith("replica-") or int(role.removeprefix("replica-")) >= spec.compute.replicas:
            raise RunStateError(f"{role!r} is not a replica of run {run_id}")
        job, handle = self._start_attempt(run, role)
        launcher, store = self.ctx.launcher_for(run), self.ctx.store_for(run)
        launcher.wait_ready(spec, [handle], self.ctx.secrets_for(run))
        assert handle.endpoint is not None, "wait_ready returns once the replica answers at its endpoint"
        upstreams = UpstreamsRecord.model_validate_json(store.get_bytes(layout.control_key(run_id, UPSTREAMS)))
        upstreams.replicas = [u for u in upstreams.replicas if u.role != role] + [
            Upstream(role=role, url=handle.endpoint)
        ]
        upstreams.updated = time.time()
        store.put_bytes(layout.control_key(run_id, UPSTREAMS), upstreams.model_dump_json().encode())
        jobs = JobsRecord.model_validate_json(store.get_bytes(layout.control_key(run_id, JOBS)))
        jobs.jobs = [j for j in jobs.jobs if j.role != role] + launcher.describe_jobs(spec, [handle]).jobs
        store.put_bytes(layout.control_key(run_id, JOBS), jobs.model_dump_json().encode())
        with self.ctx.db.session() as session:
            row = session.get_one(Job, job.id)
            row.endpoint = handle.endpoint
            session.add(row)
            session.commit()
            session.refresh(row)
        self._event(run_id, "replica_replaced", f"{role} replaced (attempt {job.attempt}) at {handle.endpoint}", "info")
        return row

    def _start_attempt(self, run: Run, role: str) -> tuple[Job, JobHandle]:
        """Cancel the role's current job if it still runs, start the next attempt, and record it."""
        spec, launcher = self.ctx.spec(run), self.ctx.launcher_for(run)
        with self.ctx.db.session() as session:
            previous = session.exec(
                select(Job).where(Job.run_id == run.id, Job.role == role).order_by(col(Job.attempt).desc())
            ).first()
        if previous is not None and previous.stage not in ("completed", "error", "canceled"):
            launcher.cancel(self.ctx.handle(previous))
        secrets = self.ctx.secrets_for(run)
        launcher.prepare(spec, secrets, self.ctx.store_for(run))
        handle = launcher.start_job(spec, role, secrets)
        job = job_row(self.ctx, run, handle, (previous.attempt + 1) if previous else 1)
        with self.ctx.db.session() as session:
            session.add(job)
            session.commit()
            session.refresh(job)
        return job, handle

    # --- stopping and deleting ------------------------------------------------------------------------------------

    def stop(self, run_id: str, reason: str = "stopped from the panel", kind: str = "stop", level: str = "info") -> Run:
        """Ask the trainer to save and exit; the poller cancels the jobs if it has not within the grace period.

        `kind` and `level` are the event's: a stop the panel decides on (a cost cap) is a warning of its own kind.
        """
        run = self.get(run_id)
        if run.status in TERMINAL_STATUSES:
            return run
        store = self.ctx.store_for(run)
        store.put_bytes(layout.control_key(run_id, STOP), StopRequest(reason=reason).model_dump_json().encode())
        self._set(run_id, status="stopping", stop_requested_at=time.time(), status_message=reason)
        self._event(run_id, kind, reason, level)
        return self.get(run_id)

    def dismiss_alert(self, run_id: str, event_id: int) -> None:
        """Put an alert away: it leaves the banner and stays in the run's alert history, marked dismissed; a
        condition that is still true does not raise it again until it has ended once."""
        self.get(run_id)  # the owner check
        with self.ctx.db.session() as session:
            event = session.get(Event, event_id)
            if event is None or event.run_id != run_id:
                raise RunStateError(f"run {run_id} has no alert {event_id}")
            event.active, event.dismissed = False, True
            session.add(event)
            session.commit()

    def delete(self, run_id: str, delete_bucket_data: bool = False) -> None:
        """Forget a finished run. Its adapters stay in the bucket unless `delete_bucket_data` says otherwise."""
        run = self.get(run_id)
        if run.status not in (*TERMINAL_STATUSES, "draft"):
            raise RunStateError(f"run {run_id} is {run.status}; stop it before deleting it")
        if delete_bucket_data:
            self.ctx.store_for(run).delete_prefix(layout.run_prefix(run_id))
        with self.ctx.db.session() as session:
            for table in (
                MetricPoint,
                RolloutSample,
                ProxySnapshot,
                ReplicaStatus,
                Event,
                PollCursor,
                ResumePoint,
                Launch,
                AdapterVersion,
                VersionScore,
                Job,
            ):
                session.execute(delete(table).where(col(table.run_id) == run_id))
            session.delete(session.get(Run, run_id))
            session.commit()

    # --- helpers ----------------------------------------------------------------------------------------------------

    def _set(self, run_id: str, **fields: Any) -> None:
        with self.ctx.db.session() as session:
            run = session.get(Run, run_id)
            for key, value in fields.items():
                setattr(run, key, value)
            session.add(run)
            session.commit()

    def _event(self, run_id: str, kind: str, message: str, level: str) -> None:
        record_event(self.ctx.db, run_id, self.owner, kind, message, level)


def check_hosting(spec: RunSpec) -> None:
    """On a shared panel (a Space), local jobs run on the panel's own machine, next to every user's data: they may
    only run built-in rewards. User code runs in the user's own HF Jobs there."""
    if on_space() and spec.compute.backend == "local":
        for index, reward in enumerate(spec.rewards):
            if reward.kind == "code":
                raise RunStateError(
                    f"rewards.{index}: on a shared panel, code rewards run only on HF Jobs (in your own jobs); "
                    "switch compute to HF Jobs or use a built-in reward"
                )


def with_bucket_region(spec: RunSpec, store: ObjectStore) -> RunSpec:
    """`spec` with its S3 bucket's region filled in when it was left empty, so no job signs for the wrong one."""
    if spec.storage.region or not spec.storage.uri.startswith("s3://") or not isinstance(store, S3Store):
        return spec
    region = store.bucket_region()
    if region is None:
        return spec  # preflight refuses such a bucket; a run created without it fails at the bootstrap, saying so
    return spec.model_copy(update={"storage": spec.storage.model_copy(update={"region": region})})


def run_row(
    spec: RunSpec,
    owner: str,
    status: str,
    store_credential_id: int | None = None,
    hf_credential_id: int | None = None,
    wandb_credential_id: int | None = None,
    message: str = "",
) -> Run:
    """The database row of a run, as its spec describes it."""
    return Run(
        id=spec.run_id,
        owner=owner,
        name=spec.name or spec.run_id,
        status=status,
        status_message=message,
        spec_json=spec.to_json(),
        storage_uri=spec.storage.uri,
        backend=spec.compute.backend,
        parent_run_id=spec.parent.run_id if spec.parent else None,
        parent_version=spec.parent.version if spec.parent else None,
        store_credential_id=store_credential_id,
        hf_credential_id=hf_credential_id,
        wandb_credential_id=wandb_credential_id,
        created_at=time.time(),
        max_steps=spec.grpo.max_steps,
    )
