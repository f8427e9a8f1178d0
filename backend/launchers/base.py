"""One launcher interface for every execution backend, and the launch sequence they all share.

A run is launched the same way everywhere: start the replica jobs, wait until each answers `/health` (with its bearer
token), record their URLs in `control/upstreams.json` and the jobs in `control/jobs.json`, then start the trainer. If
any job fails to start or errors on the way, everything already started is cancelled and the error carries that job's
log tail: nothing keeps running, nothing keeps billing. A launch can be resumed: the jobs of the run that are still
alive (a panel died mid-launch) are found and taken over, so a role never gets a second job. Backends differ only in
how one job is started, found, inspected, logged and cancelled.
"""

from __future__ import annotations

import logging
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, cast

import requests

from backend.launch.plan import JobPlan, RunPlan, derived_values
from jobs import settings
from jobs.contract import RunSpec, layout, timeout_seconds
from jobs.contract.control import JOBS, UPSTREAMS, JobRef, JobsRecord, Upstream, UpstreamsRecord
from jobs.contract.durations import duration
from jobs.replica.engine_command import EngineChoice
from jobs.runtime import spec_uri
from jobs.store import ObjectStore, StoreCredentials

log = logging.getLogger(__name__)
Stage = Literal["scheduling", "running", "completed", "error", "canceled"]
TERMINAL: frozenset[str] = frozenset({"completed", "error", "canceled"})
REPLICA_PORT = 8000
CANCEL_WAIT_S = 120.0  # how long a cancelled job may take to end before the panel says where to cancel it by hand
SMOKE_ROLE = "smoke"  # the one job of a smoke test (backend/services/smoke.py): a replica's image, port and flavor
# `evaluator-<request id>`: an evaluation of a run's stored versions (jobs/evaluation/after_run.py), a replica's image
# and flavor, no port.
EVALUATOR_ROLE = "evaluator-"


@dataclass
class RunSecrets:
    """What a run's jobs need to know and nobody else may see. Travels only as Job secrets / process environment."""

    hf_token: str | None = None
    store: StoreCredentials | None = None
    wandb_key: str | None = None  # the trainer's only (it alone reports)
    # The bearer token replicas demand and the proxy sends. On HF Jobs it is the HF token (the platform checks it);
    # locally a random one per run.
    replica_token: str = field(default_factory=lambda: secrets.token_urlsafe(24))

    def __repr__(self) -> str:
        return "RunSecrets(***)"

    def store_env(self) -> dict[str, str]:
        return self.store.as_env() if self.store else {}


@dataclass
class JobHandle:
    run_id: str
    role: str  # trainer, replica-<i>
    job_id: str
    backend: str
    url: str | None = None  # a page about the job, if the backend has one
    endpoint: str | None = None  # a replica's base URL


@dataclass
class JobState:
    stage: Stage
    message: str = ""
    started_at: float | None = None
    finished_at: float | None = None

    @property
    def ran_seconds(self) -> float:
        """How long the job ran (0 until it has started and ended)."""
        return self.finished_at - self.started_at if self.started_at and self.finished_at else 0.0


class LaunchInterrupted(BaseException):
    """Another panel took this launch over (this one stopped renewing its lease): leave its jobs running.

    A BaseException, so that nothing on the way treats it as a failed launch and cancels the jobs.
    """


class LaunchError(RuntimeError):
    """A run could not be started; `role` and `log_tail` say which job failed and why."""

    def __init__(self, message: str, role: str | None = None, log_tail: str = ""):
        super().__init__(message)
        self.role, self.log_tail = role, log_tail


def job_module_args(spec: RunSpec, role: str, port: int | str = REPLICA_PORT, host: str = "0.0.0.0") -> list[str]:
    """What a job runs, as `python -m <these>`: the same on every backend (each adds how Python is invoked)."""
    uri = spec_uri(spec.storage, spec.run_id)
    store_args: list[str] = []
    if spec.storage.endpoint:
        store_args += ["--store-endpoint", spec.storage.endpoint]
    if spec.storage.region:
        store_args += ["--store-region", spec.storage.region]
    if role == "trainer":
        return [*trainer_launcher(spec.compute.training_ranks), "jobs.trainer", "--spec", uri, *store_args]
    if role == SMOKE_ROLE:
        return ["jobs.smoke", "--spec", uri, "--host", host, "--port", str(port), *store_args]
    if role.startswith(EVALUATOR_ROLE):
        request = layout.eval_request_key(spec.run_id, role.removeprefix(EVALUATOR_ROLE))
        return ["jobs.evaluation.after_run", "--spec", uri, "--request", request, *store_args]
    index = role.removeprefix("replica-")
    return [
        "jobs.replica",
        "--spec",
        uri,
        "--index",
        index,
        "--host",
        host,
        "--port",
        str(port),
        "--engine",
        spec.compute.engine,
        *store_args,
    ]


def trainer_launcher(processes: int) -> list[str]:
    """How the trainer module is started, as `python -m <these> jobs.trainer ...`: directly for one process, through
    `accelerate launch` (torchrun, DDP) for several, on GPUs and on the CPU alike.

    `--multi_gpu` even on the CPU: `--cpu --num_processes N` silently starts one process (accelerate's simple
    launcher starts several CPU processes only under mpirun); through torchrun the process group is gloo without a
    GPU. Mixed precision is the trainer's own setting (bf16 autocast on GPU), not the launcher's.
    """
    if processes == 1:
        return []
    return [
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        str(processes),
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        "0",
        "-m",
    ]


class Launcher(ABC):
    backend: str
    startup_deadline: float = 900.0  # seconds from a replica's start to its /health, unless the spec sets one
    poll_interval: float = 2.0

    # --- what each backend implements ---------------------------------------------------------------------------

    @abstractmethod
    def plan_job(self, spec: RunSpec, role: str, secrets: RunSecrets) -> JobPlan:
        """Exactly what `start_job` submits for `role` (see backend/launch/plan.py)."""

    @abstractmethod
    def trainer_cuda(self, spec: RunSpec) -> bool:
        """Whether the trainer job will train on GPUs (which decides its batch shape and precision)."""

    @abstractmethod
    def replica_engine(self, spec: RunSpec) -> EngineChoice:
        """The engine the replicas will run and why, as they decide it where they run (jobs/replica/engine_command.py);
        raises ValueError naming compute.engine's fix when the one asked for cannot run there."""

    @abstractmethod
    def start_job(self, spec: RunSpec, role: str, secrets: RunSecrets) -> JobHandle:
        """Start one job, as `plan_job` describes it, and return at once (a replica's endpoint may only be known
        later, see `endpoint`)."""

    @abstractmethod
    def state(self, job: JobHandle) -> JobState: ...

    @abstractmethod
    def logs(self, job: JobHandle, tail: int = 50) -> list[str]:
        """The newest `tail` lines of the job's log (job cards, launch errors)."""

    @abstractmethod
    def write_log(self, job: JobHandle, destination: Path) -> None:
        """The job's whole log as the backend has it now, written to `destination`: nothing is cut here, start-up
        errors and warnings included (the panel shows the newest part and says so; the download is all of it)."""

    @abstractmethod
    def cancel(self, job: JobHandle) -> None:
        """Stop the job; cancelling a finished job is not an error."""

    @abstractmethod
    def find_jobs(self, spec: RunSpec) -> list[JobHandle]:
        """The run's jobs that have not ended, found on the backend itself (not in the panel's database), so that a
        launch interrupted between starting a job and recording it can find that job."""

    def plan(self, spec: RunSpec, secrets: RunSecrets, parameters: int | None = None) -> RunPlan:
        """Every job a launch of `spec` submits, and the values derived for its hardware (for a model of
        `parameters`, where known)."""
        roles = [f"replica-{index}" for index in range(spec.compute.replicas)] + ["trainer"]
        return RunPlan(
            run_id=spec.run_id,
            backend=spec.compute.backend,
            namespace=spec.compute.namespace,
            jobs=[self.plan_job(spec, role, secrets) for role in roles],
            derived=derived_values(spec, self.trainer_cuda(spec), parameters, engine=self.replica_engine(spec)),
            spec=spec.model_dump(mode="json"),
        )

    def prepare(self, spec: RunSpec, secrets: RunSecrets, store: ObjectStore) -> None:
        """Whatever must exist before any job of the run starts (HF Jobs: the code bundle). Idempotent."""
        return None  # local jobs run this checkout's code directly

    def price_per_hour(self, flavor: str) -> float | None:
        """$/hour of `flavor` on this backend, None if it has no such flavor."""
        return 0.0  # local processes cost nothing

    def cost_usd(self, flavor: str, state: JobState) -> float | None:
        """What a job of `flavor` that ran as `state` says cost (queueing is not billed); None without a price."""
        price = self.price_per_hour(flavor)
        return price * state.ran_seconds / 3600 if price is not None else None

    def end(self, job: JobHandle, wait: float = CANCEL_WAIT_S) -> JobState:
        """Cancel `job` unless it has ended, and wait until the backend says it has: nothing is left billing."""
        state = self.state(job)
        if state.stage in TERMINAL:
            return state
        self.cancel(job)
        deadline = time.monotonic() + wait
        while (state := self.state(job)).stage not in TERMINAL:
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"the {job.role} job did not end {wait:.0f}s after its cancel; cancel it at {job.url}"
                )
            time.sleep(self.poll_interval)
        return state

    def endpoint(self, job: JobHandle) -> str | None:
        """The replica's base URL once the backend exposes it."""
        return job.endpoint

    def describe_jobs(self, spec: RunSpec, jobs: list[JobHandle]) -> JobsRecord:
        return JobsRecord(
            backend=spec.compute.backend,
            namespace=spec.compute.namespace,
            jobs=[JobRef(role=job.role, job_id=job.job_id) for job in jobs],
        )

    # --- the launch sequence every backend shares ----------------------------------------------------------------

    def launch(
        self,
        spec: RunSpec,
        secrets: RunSecrets,
        store: ObjectStore,
        on_started: Callable[[JobHandle], None] = lambda job: None,
        on_step: Callable[[str], None] = lambda step: None,
        on_progress: Callable[[list[JobStart]], None] = lambda starts: None,
    ) -> list[JobHandle]:
        """Start replicas, wait until they are healthy, publish their URLs, then start the trainer and wait until it
        has left the queue.

        Jobs of the run that are still alive (an interrupted launch started them) are taken over instead of started
        again. `on_started` sees each job as soon as it exists (or is found), so the panel can show it while the
        others start; `on_step` sees each step (preparing, replicas, healthy, trainer) as it begins, and may raise
        LaunchInterrupted to give the launch up without cancelling anything; `on_progress` sees where each job is
        while they start (see `wait_ready`).
        """
        on_step("preparing")
        self.prepare(spec, secrets, store)
        alive = {job.role: job for job in self.find_jobs(spec)}
        started = list(alive.values())
        try:
            for job in started:
                on_started(job)
            on_step("replicas")
            for index in range(spec.compute.replicas):
                if f"replica-{index}" not in alive:
                    started.append(self.start_job(spec, f"replica-{index}", secrets))
                    on_started(started[-1])
            replicas = [job for job in started if job.role != "trainer"]
            on_step("healthy")
            self.wait_ready(spec, replicas, secrets, on_progress)
            # Ready replicas have their endpoint (`_ready`); the record's model refuses one without.
            upstreams = UpstreamsRecord(
                replicas=[Upstream(role=job.role, url=cast(str, job.endpoint)) for job in replicas]
            )
            store.put_bytes(layout.control_key(spec.run_id, UPSTREAMS), upstreams.model_dump_json().encode())
            store.put_bytes(
                layout.control_key(spec.run_id, JOBS), self.describe_jobs(spec, replicas).model_dump_json().encode()
            )
            on_step("trainer")
            if "trainer" not in alive:
                started.append(self.start_job(spec, "trainer", secrets))
                on_started(started[-1])
            self.wait_ready(spec, [job for job in started if job.role == "trainer"], secrets, on_progress)
        except LaunchInterrupted:
            raise
        except BaseException:
            self.cancel_all(started)
            raise
        return started

    def wait_ready(
        self,
        spec: RunSpec,
        jobs: list[JobHandle],
        secrets: RunSecrets,
        on_progress: Callable[[list[JobStart]], None] = lambda starts: None,
    ) -> None:
        """Wait until every job is ready — a replica answers `/health`, the trainer runs — timing each stage of each
        job against its own limit.

        Queueing for a flavor (SCHEDULING) and starting up (image pull, install, model load, health) are bounded
        separately (`compute.queue_timeout`, `compute.startup_timeout`): a busy flavor must not use up the start-up
        time of replicas that then load quickly, and a replica that takes long to load must not be blamed on the
        queue. A trainer stuck in the queue is bounded too: the replicas bill meanwhile. `on_progress` sees where
        each job is, at every poll.
        """
        limits = {"queued": timeout_seconds(spec.compute.queue_timeout), "starting": startup_seconds(spec, self)}
        headers = {"Authorization": f"Bearer {secrets.replica_token}"}
        starts = [JobStart(job, limit=limits["queued"]) for job in jobs]
        while True:
            for start in starts:
                if start.stage == "ready":
                    continue
                job, state = start.job, self.state(start.job)
                if state.stage in TERMINAL:
                    raise LaunchError(
                        f"{job.role} ended before it was ready ({state.stage}: {state.message})",
                        job.role,
                        "\n".join(self.logs(job, 30)),
                    )
                if state.stage != "scheduling" and start.stage == "queued":
                    start.enter("starting", limits["starting"])
                if self._ready(job, state, headers):
                    log.info("%s is ready%s", job.role, f" at {job.endpoint}" if job.endpoint else "")
                    start.enter("ready", 0)
                elif start.elapsed() > start.limit:
                    raise self._overdue(spec, start)
            on_progress(starts)
            if all(start.stage == "ready" for start in starts):
                return
            time.sleep(self.poll_interval)

    def _ready(self, job: JobHandle, state: JobState, headers: dict[str, str]) -> bool:
        if job.role == "trainer":
            return state.stage == "running"
        job.endpoint = endpoint = self.endpoint(job)
        if not endpoint:
            return False
        return _healthy(endpoint, headers)

    def _overdue(self, spec: RunSpec, start: JobStart) -> LaunchError:
        role, waited = start.job.role, duration(start.elapsed())
        flavor_field = "trainer_flavor" if role == "trainer" else "replica_flavor"
        if start.stage == "queued":
            message = (
                f"{role} waited {waited} for a {getattr(spec.compute, flavor_field)} machine without starting "
                f"(compute.queue_timeout: {spec.compute.queue_timeout}): the flavor is busy; raise "
                f"compute.queue_timeout to wait longer, or choose another compute.{flavor_field}"
            )
        else:
            message = (
                f"{role} started but did not answer /health within {duration(start.limit)} (compute.startup_timeout: "
                f"{spec.compute.startup_timeout or duration(start.limit)}): pulling the image, installing and loading "
                "the model took too long or hung; its log's last lines follow. Raise compute.startup_timeout for a "
                "large model"
            )
        return LaunchError(message, role, "\n".join(self.logs(start.job, 30)))

    def cancel_all(self, jobs: list[JobHandle]) -> None:
        for job in jobs:
            try:
                self.cancel(job)
            except Exception as error:  # keep cancelling the others
                log.error("could not cancel %s (%s): %s", job.role, job.job_id, error)


def startup_seconds(spec: RunSpec, launcher: Launcher) -> int:
    """How long a replica may take from its start to answering /health: the spec's limit, else the backend's."""
    if spec.compute.startup_timeout:
        return timeout_seconds(spec.compute.startup_timeout)
    return int(launcher.startup_deadline)


@dataclass
class JobStart:
    """Where a job's start is — queued for a machine, starting up, ready — since when (this machine's clock), and
    how long it may stay in that stage."""

    job: JobHandle
    stage: Literal["queued", "starting", "ready"] = "queued"
    since: float = field(default_factory=time.monotonic)
    limit: int = 0  # seconds

    def enter(self, stage: Literal["starting", "ready"], limit: int) -> None:
        self.stage, self.since, self.limit = stage, time.monotonic(), limit

    def elapsed(self) -> float:
        return time.monotonic() - self.since

    def __str__(self) -> str:
        if self.stage == "ready":
            return f"{self.job.role} ready"
        return f"{self.job.role} {self.stage} {duration(self.elapsed())} (limit {duration(self.limit)})"


def _healthy(endpoint: str, headers: dict[str, str]) -> bool:
    try:
        return requests.get(endpoint.rstrip("/") + "/health", headers=headers, timeout=5).status_code == 200
    except requests.RequestException:
        return False


def job_env(role: str, secrets: RunSecrets, on_hf_jobs: bool) -> dict[str, str]:
    """The secret environment of one job (passed as Job secrets on HF Jobs, process environment locally)."""
    env = dict(secrets.store_env())
    if secrets.hf_token:
        env[settings.HF_TOKEN.name] = secrets.hf_token
    if role == "trainer":
        env[settings.UPSTREAM_TOKEN.name] = secrets.replica_token
        if secrets.wandb_key:
            env[settings.WANDB_API_KEY.name] = secrets.wandb_key
    elif not on_hf_jobs:  # on HF Jobs the platform checks the bearer in front of the replica
        env[settings.REPLICA_TOKEN.name] = secrets.replica_token
    return env
