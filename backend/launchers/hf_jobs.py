"""Hugging Face Jobs: replicas and the trainer as Jobs, through `huggingface_hub`'s HfApi.

- Images are pinned (the spec's, default `vllm/vllm-openai:v0.27.1` for both); flavors, replica count and timeout
  come from the spec; the namespace is always passed explicitly (no rate-limited whoami on every call).
- The HF token and the bucket keys travel as **Job secrets** only; the command and the environment carry nothing
  secret (tests check every submitted job spec).
- Our code reaches the job through the store: a content-addressed bundle of `jobs/`, fetched by a short stdlib-only
  bootstrap (jobs/bootstrap.py).
- Replicas expose port 8000; their URLs come from the job's `expose_urls`. The platform checks the bearer (the HF
  token) in front of every exposed port, so the proxy sends the HF token upstream.
- Submissions are idempotent: each carries a unique label, and a submission whose answer was lost (5xx, timeout) is
  looked up by that label before it is retried, so a flaky Hub never starts a job twice. 5xx, 429 and transport
  errors (huggingface_hub's client raises httpx2's, which are not `OSError`) are retried with backoff, a 429 after
  the time its `RateLimit` (or `Retry-After`) header gives; 401 is reported as a rejected token.
- Every Hub call is bounded: huggingface_hub's own client has no timeout at all, so a stuck request would hang a
  launch forever; `bound_hub_calls` gives the process's client one (`HUB_TIMEOUT`), and a call that times out is
  retried like any transport error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from secrets import token_hex
from typing import TypeVar, cast

import httpx2
from huggingface_hub import HfApi, JobInfo, set_client_factory
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import parse_ratelimit_headers  # type: ignore[attr-defined]  # public, but built lazily
from huggingface_hub.utils._http import default_client_factory

from backend.launch.bundle import bootstrap_source, build_bundle, bundle_digest, upload_bundle
from backend.launch.plan import JobPlan
from backend.launchers.base import (
    EVALUATOR_ROLE,
    REPLICA_PORT,
    TERMINAL,
    JobHandle,
    JobState,
    Launcher,
    LaunchError,
    RunSecrets,
    Stage,
    job_env,
    job_module_args,
)
from jobs.contract import RunSpec, layout, parse_storage_uri, timeout_seconds
from jobs.hub_jobs import cancel_unless_ended
from jobs.replica.engine_command import EngineChoice, decide_engine
from jobs.retry import RetryPolicy, retry_call
from jobs.store import ObjectStore, S3Store

log = logging.getLogger(__name__)
T = TypeVar("T")
LABEL_RUN, LABEL_ROLE, LABEL_SUBMISSION = "grpo-run", "grpo-role", "grpo-submission"
_STAGES: dict[str, Stage] = {
    "SCHEDULING": "scheduling",
    "RUNNING": "running",
    "COMPLETED": "completed",
    "ERROR": "error",
    "CANCELED": "canceled",
    "DELETED": "canceled",
}
# Non-secret environment of every job.
_JOB_ENV = {"PYTHONUNBUFFERED": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}


class HubTokenRejected(LaunchError):
    pass


class UnknownFlavor(LaunchError):
    pass


def _status(error: BaseException) -> int | None:
    response = getattr(error, "response", None)
    return getattr(response, "status_code", None)


def _retry_after(error: BaseException) -> float | None:
    """Seconds the Hub asks us to wait: its `RateLimit` header (`"api";r=0;t=55`) once the window is spent, else a
    `Retry-After`."""
    response = getattr(error, "response", None)
    headers = getattr(response, "headers", None) or {}
    limit = parse_ratelimit_headers(headers)
    if limit is not None and limit.remaining == 0:
        return float(limit.reset_in_seconds)
    try:
        return float(headers["Retry-After"]) if "Retry-After" in headers else None
    except ValueError:
        return None


# The longest wait for a rate limit to reset before the next try (a launch's Hub calls stay bounded in time).
MAX_RATE_LIMIT_WAIT = 120.0


def _hub_transient(error: BaseException) -> bool:
    """A rate limit, a server error or a transport failure: worth another try."""
    if isinstance(error, HfHubHTTPError):
        return _status(error) in (429, 500, 502, 503, 504)
    return isinstance(error, OSError | httpx2.TransportError)


def _hub_wait(error: BaseException, planned: float) -> float:
    """The wait the Hub asked for (a 429's headers), else the policy's; capped either way."""
    asked = _retry_after(error) if isinstance(error, HfHubHTTPError) else None
    return min(asked or planned, MAX_RATE_LIMIT_WAIT)


# Seconds to connect, and between two reads or writes, of any Hub call (log reads stream, so no total bound).
HUB_TIMEOUT = 30.0
# A running job's log is an event stream even when not followed: the Hub replays what it has, then sends each new line
# as it comes; huggingface_hub stops at the first line stamped after the answer's `Date`, or after 5 s without a line.
# The lines are stamped by the job's machine, the Date by the API server: with the machine's clock behind, a job that
# logs often holds the reader forever (and the poller, which reads every running job's tail on each poll, with it).
# So a read ends after this long, whatever the clocks say.
LOG_TAIL_READ_S = 10.0
WHOLE_LOG_READ_S = 60.0


def bound_hub_calls(timeout: float = HUB_TIMEOUT) -> None:
    """Give huggingface_hub's shared client (this process's every Hub call) a timeout; it has none by default.

    Built from the library's own default client, so its request hooks (headers, offline mode) stay; set again only
    when the timeout changes.
    """
    global _bounded
    if _bounded == timeout:
        return

    def bounded_client() -> httpx2.Client:
        client = default_client_factory()
        client.timeout = httpx2.Timeout(timeout)
        return client

    set_client_factory(bounded_client)
    _bounded = timeout


_bounded: float | None = None


def hub_replica_engine(spec: RunSpec) -> EngineChoice:
    """The replicas' engine on HF Jobs: the image brings vLLM built for GPUs (`vllm serve`); the replica flavor decides
    whether there is a GPU to run it on. ValueError for `vllm` on a flavor without one."""
    return decide_engine(spec.compute.engine, gpu_build=True, cpu_build=None, cuda=spec.compute.replica_gpus > 0)


class HfJobsLauncher(Launcher):
    backend = "hf_jobs"
    startup_deadline = 900.0  # a cold vLLM image pull and model load take minutes
    poll_interval = 5.0

    def __init__(self, token: str | None, endpoint: str | None = None, retry: RetryPolicy = RetryPolicy(6, 1.0, 30.0)):
        bound_hub_calls()
        self.api = HfApi(token=token, endpoint=endpoint)
        self.retry = retry
        self._hardware: dict[str, float] | None = None
        self._namespaces: dict[str, str | None] = {}  # job id -> namespace
        self._bundle_bytes: bytes | None = None  # this checkout's code bundle, built once

    # --- calling the Hub -----------------------------------------------------------------------------------------

    def _call(self, fn: Callable[[], T], what: str) -> T:
        try:
            return retry_call(fn, _hub_transient, self.retry, what=f"the Hub call to {what}", wait=_hub_wait)
        except HfHubHTTPError as error:
            status = _status(error)
            if status == 401:
                raise HubTokenRejected(
                    f"the Hub rejected the token while trying to {what}; check that it is valid and may run Jobs "
                    "in this namespace (a fine-grained token needs the 'jobs' permission)"
                ) from None
            raise LaunchError(f"the Hub refused to {what} (HTTP {status}): {str(error)[:300]}") from None
        except (OSError, httpx2.TransportError) as error:  # connection refused or reset, a call timed out
            raise LaunchError(f"could not reach the Hub to {what}: {error}") from None

    # --- prices ----------------------------------------------------------------------------------------------------

    def prices_per_hour(self) -> dict[str, float]:
        """$/hour of every flavor the Hub offers (unit prices are per minute)."""
        if self._hardware is None:
            hardware = self._call(self.api.list_jobs_hardware, "list the hardware")
            self._hardware = {
                item.name: float(item.unit_cost_usd) * (60 if item.unit_label == "minute" else 1) for item in hardware
            }
        return self._hardware

    def price_per_hour(self, flavor: str) -> float | None:
        return self.prices_per_hour().get(flavor)

    def check_flavors(self, spec: RunSpec) -> None:
        prices = self.prices_per_hour()
        for field, flavor in (
            ("trainer_flavor", spec.compute.trainer_flavor),
            ("replica_flavor", spec.compute.replica_flavor),
        ):
            if flavor not in prices:
                raise UnknownFlavor(
                    f"compute.{field}: the Hub has no flavor {flavor!r}; choose one of {', '.join(sorted(prices))}"
                )

    # --- the launcher interface ------------------------------------------------------------------------------------

    def prepare(self, spec: RunSpec, run_secrets: RunSecrets, store: ObjectStore) -> None:
        """Check flavors and credentials, and put the code bundle where the jobs' bootstrap can fetch it."""
        self.check_flavors(spec)
        if not isinstance(store, S3Store):
            raise LaunchError("storage.uri: HF Jobs cannot reach a local folder; use an hf:// or s3:// bucket")
        if not run_secrets.hf_token:
            raise LaunchError("an HF token is required to run HF Jobs; add one in the credentials form")
        upload_bundle(store, spec.run_id, self._bundle())

    def trainer_cuda(self, spec: RunSpec) -> bool:
        return spec.compute.trainer_gpus > 0

    def replica_engine(self, spec: RunSpec) -> EngineChoice:
        return hub_replica_engine(spec)

    def plan_job(self, spec: RunSpec, role: str, run_secrets: RunSecrets) -> JobPlan:
        # The bootstrap reads the bundle with the bucket keys the job holds anyway; its arguments are not secret.
        location = parse_storage_uri(spec.storage.uri, endpoint=spec.storage.endpoint, region=spec.storage.region)
        digest = bundle_digest(self._bundle())
        bundle = [
            digest,
            location.endpoint or "-",
            location.region or "us-east-1",
            cast(str, location.bucket),  # HF Jobs reach only a bucket (`prepare` refuses a local folder)
            location.object_key(layout.code_key(spec.run_id, digest)),
        ]
        replica = role != "trainer"
        return JobPlan(
            role=role,
            command=["python3", "-c", bootstrap_source(), *bundle, *job_module_args(spec, role)],
            env=dict(_JOB_ENV),
            secrets=sorted(job_env(role, run_secrets, on_hf_jobs=True)),
            ports=[REPLICA_PORT] if replica and not role.startswith(EVALUATOR_ROLE) else [],
            image=spec.compute.replica_image if replica else spec.compute.trainer_image,
            flavor=spec.compute.replica_flavor if replica else spec.compute.trainer_flavor,
            timeout_s=timeout_seconds(spec.compute.timeout),
            labels={LABEL_RUN: spec.run_id, LABEL_ROLE: role},
            name=f"grpo-{spec.run_id}-{role}",  # run ids and roles hold only [a-z0-9-], as job names must
        )

    def _bundle(self) -> bytes:
        if self._bundle_bytes is None:
            self._bundle_bytes = build_bundle()
        return self._bundle_bytes

    def start_job(self, spec: RunSpec, role: str, run_secrets: RunSecrets) -> JobHandle:
        plan = self.plan_job(spec, role, run_secrets)
        submission = token_hex(8)
        namespace = spec.compute.namespace

        def submit() -> JobInfo:
            existing = self._find(namespace, submission)
            if existing is not None:  # an earlier try was accepted but its answer was lost
                return existing
            return self.api.run_job(
                image=cast(str, plan.image),  # `plan_job` gives every HF job an image
                command=plan.command,
                env=plan.env,
                secrets=job_env(role, run_secrets, on_hf_jobs=True),
                flavor=plan.flavor,
                timeout=plan.timeout_s,
                labels={**plan.labels, LABEL_SUBMISSION: submission},  # one per submission: see _find
                expose=plan.ports or None,
                name=plan.name,
                namespace=namespace,
            )

        info = self._call(submit, f"start the {role} job")
        self._namespaces[info.id] = namespace
        return JobHandle(
            run_id=spec.run_id,
            role=role,
            job_id=info.id,
            backend=self.backend,
            url=info.url,
            endpoint=next(iter(info.status.expose_urls or []), None) if info.status else None,
        )

    def find_jobs(self, spec: RunSpec) -> list[JobHandle]:
        run_id, namespace = spec.run_id, spec.compute.namespace
        jobs = self._call(
            lambda: list(self.api.list_jobs(labels={LABEL_RUN: run_id}, namespace=namespace)), "list the run's jobs"
        )
        found = []
        for info in jobs:
            labels = info.labels or {}
            stage = _STAGES.get(info.status.stage if info.status else "", "scheduling")
            if labels.get(LABEL_RUN) != run_id or LABEL_ROLE not in labels or stage in TERMINAL:
                continue  # the label filter is the server's; a job of another run must never be taken over
            self._namespaces[info.id] = namespace
            found.append(
                JobHandle(run_id=run_id, role=labels[LABEL_ROLE], job_id=info.id, backend=self.backend, url=info.url)
            )
        return found

    def _find(self, namespace: str | None, submission: str) -> JobInfo | None:
        # list_jobs is lazy: materialise it inside the retried call, where its request actually happens.
        jobs = self._call(
            lambda: list(self.api.list_jobs(labels={LABEL_SUBMISSION: submission}, namespace=namespace)),
            "look up a submitted job",
        )
        # The filter is the server's; check the label on what came back, so no other job is mistaken for this one.
        return next((job for job in jobs if (job.labels or {}).get(LABEL_SUBMISSION) == submission), None)

    def _inspect(self, job: JobHandle) -> JobInfo:
        return self._call(
            lambda: self.api.inspect_job(job_id=job.job_id, namespace=self._namespace(job)),
            f"inspect the {job.role} job",
        )

    def _namespace(self, job: JobHandle) -> str | None:
        """The job's namespace: remembered from submission, or read from its page URL (…/jobs/<ns>/<id>)."""
        if job.job_id in self._namespaces:
            return self._namespaces[job.job_id]
        return job.url.rstrip("/").split("/")[-2] if job.url else None

    def state(self, job: JobHandle) -> JobState:
        info = self._inspect(job)
        stage = _STAGES.get(info.status.stage if info.status else "", "scheduling")
        started_at, finished_at = getattr(info, "started_at", None), getattr(info, "finished_at", None)
        started = started_at.timestamp() if started_at else None
        finished = finished_at.timestamp() if finished_at else None
        return JobState(stage, (info.status.message or "") if info.status else "", started, finished)

    def endpoint(self, job: JobHandle) -> str | None:
        info = self._inspect(job)
        urls = info.status.expose_urls if info.status else None
        return urls[0] if urls else None

    def logs(self, job: JobHandle, tail: int = 50) -> list[str]:
        def fetch() -> list[str]:
            lines = self.api.fetch_job_logs(job_id=job.job_id, namespace=self._namespace(job), tail=tail)
            return list(_read_for(lines, LOG_TAIL_READ_S))

        try:
            return self._call(fetch, f"read the {job.role} job's logs")[-tail:]
        except LaunchError as error:
            return [f"(logs unavailable: {error})"]

    def write_log(self, job: JobHandle, destination: Path) -> None:
        def fetch() -> None:  # from the first line again on a retry
            with destination.open("w", encoding="utf-8") as log:
                lines = self.api.fetch_job_logs(job_id=job.job_id, namespace=self._namespace(job))
                for line in _read_for(lines, WHOLE_LOG_READ_S):
                    log.write(f"{line}\n")

        try:
            self._call(fetch, f"read the {job.role} job's logs")
        except LaunchError as error:
            destination.write_text(f"(logs unavailable: {error})\n")

    def cancel(self, job: JobHandle) -> None:
        self._call(
            lambda: cancel_unless_ended(self.api, job.job_id, self._namespace(job)), f"cancel the {job.role} job"
        )


def _read_for(lines: Iterable[str], seconds: float) -> Iterator[str]:
    """`lines` until `seconds` have passed (checked as each line arrives; a silent stream ends by the client's own
    read timeout), then the stream is closed."""
    deadline = time.monotonic() + seconds
    iterator = iter(lines)
    try:
        for line in iterator:
            yield line
            if time.monotonic() > deadline:
                return
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()
