"""A smoke test on real HF Jobs, for cents: prove the account, the bucket and the network before renting GPUs.

One `cpu-basic` job is submitted exactly as a replica would be — the run's image, the bootstrap that fetches the code
bundle from the user's bucket with the job's secrets, the exposed port behind the Hub's bearer check — but it runs
`jobs.smoke`, which reads the run's spec, writes and reads back a probe object and serves a report on `/health`. The
panel reaches that report through the job's public URL, checks the probe object from its own side, and cancels the
job. Every step is reported with its time; the first that fails ends the test and says why; what the job cost is
worked out from the flavor's price and how long it ran. Everything the test wrote to the bucket is deleted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from secrets import token_hex
from typing import TypeVar

import requests

from backend.context import PanelContext
from backend.launchers.base import SMOKE_ROLE, JobHandle, JobStart, Launcher, LaunchError, RunSecrets
from backend.services.runs import run_row
from jobs.contract import RunSpec, duration, layout
from jobs.smoke import Step
from jobs.store import ObjectStore, StoreError

log = logging.getLogger(__name__)
SMOKE_FLAVOR = "cpu-basic"
SMOKE_TIMEOUT = "10m"  # the shortest timeout HF Jobs takes; the job also ends by itself after `jobs.smoke --serve-for`
T = TypeVar("T")


@dataclass
class SmokeReport:
    steps: list[Step] = field(default_factory=list)
    cost_usd: float | None = None
    job_url: str | None = None

    @property
    def ok(self) -> bool:
        return bool(self.steps) and all(step.ok for step in self.steps)

    @property
    def failed(self) -> Step | None:
        return next((step for step in self.steps if not step.ok), None)

    def summary(self) -> str:
        total = duration(sum(step.seconds for step in self.steps))
        cost = _money(self.cost_usd)
        failed = self.failed
        if failed is None:
            return f"smoke test passed in {total}; the job cost {cost}"
        return f"smoke test failed at '{failed.name}': {failed.detail}; the job cost {cost}"


class _Failed(Exception):
    """A step failed; the report already says which and why."""


class SmokeTest:
    """Runs the smoke test for one owner, with that owner's credentials; `on_step` sees each step as it ends."""

    def __init__(self, ctx: PanelContext, owner: str, on_step: Callable[[Step], None] = lambda step: None):
        self.ctx, self.owner, self.on_step = ctx, owner, on_step

    def run(self, spec: RunSpec, store_credential_id: int | None, hf_credential_id: int | None) -> SmokeReport:
        if spec.compute.backend != "hf_jobs":
            raise ValueError("compute.backend: the smoke test runs on HF Jobs; choose Hugging Face Jobs first")
        probe = smoke_spec(spec)
        run = run_row(probe, self.owner, "draft", store_credential_id, hf_credential_id)
        launcher, secrets, store = self.ctx.launcher_for(run), self.ctx.secrets_for(run), self.ctx.fresh_store(run)
        report, job = SmokeReport(), None
        try:
            self._step(report, "upload the spec and the code bundle", lambda: _prepare(launcher, probe, secrets, store))
            job = self._step(
                report, f"submit a {SMOKE_FLAVOR} job", lambda: launcher.start_job(probe, SMOKE_ROLE, secrets)
            )
            report.job_url = job.url
            self._wait_ready(report, launcher, probe, job, secrets)
            steps = self._step(report, "read the job's report through its URL", lambda: _job_report(job, secrets))
            for step in steps:
                self._record(report, Step(f"job: {step.name}", step.seconds, step.ok, step.detail))
            if not all(step.ok for step in steps):
                raise _Failed
            key = layout.smoke_probe_key(probe.run_id, job.job_id)
            self._step(report, "read the job's probe object from the panel", lambda: _read_and_delete(store, key))
        except _Failed:
            pass
        finally:
            if job is not None:
                self._cancel(report, launcher, job)
            _clean_up(store, probe.run_id)
        return report

    def _wait_ready(
        self, report: SmokeReport, launcher: Launcher, probe: RunSpec, job: JobHandle, secrets: RunSecrets
    ) -> None:
        """Queueing and start-up, each reported as its own step (a launch times them apart too)."""
        submitted = time.monotonic()
        started: list[float] = []

        def note(starts: list[JobStart]) -> None:
            if starts[0].stage != "queued" and not started:
                started.append(time.monotonic())

        queue, start = f"wait for a {SMOKE_FLAVOR} machine", "start: fetch the code from the bucket, answer /health"
        try:
            launcher.wait_ready(probe, [job], secrets, note)
        except LaunchError as error:
            if not started:
                self._record(report, Step(queue, time.monotonic() - submitted, False, _why(error)))
            else:
                self._record(report, Step(queue, started[0] - submitted, True))
                self._record(report, Step(start, time.monotonic() - started[0], False, _why(error)))
            raise _Failed from None
        healthy = time.monotonic()
        began = started[0] if started else healthy
        self._record(report, Step(queue, began - submitted, True))
        self._record(report, Step(start, healthy - began, True, job.endpoint or ""))

    def _cancel(self, report: SmokeReport, launcher: Launcher, job: JobHandle) -> None:
        def cancel() -> str:
            state = launcher.end(job)
            report.cost_usd = launcher.cost_usd(SMOKE_FLAVOR, state)
            return f"{state.stage} after running {duration(state.ran_seconds)}"

        try:
            self._step(report, "cancel the job", cancel)
        except _Failed:
            pass

    def _step(self, report: SmokeReport, name: str, action: Callable[[], T]) -> T:
        """Run one step, record it with its time; a failure is recorded with its reason and ends the test."""
        started = time.monotonic()
        try:
            result = action()
        except (LaunchError, StoreError, ValueError, requests.RequestException) as error:
            self._record(report, Step(name, time.monotonic() - started, False, _why(error)))
            raise _Failed from None
        detail = result if isinstance(result, str) else ""
        self._record(report, Step(name, time.monotonic() - started, True, detail))
        return result

    def _record(self, report: SmokeReport, step: Step) -> None:
        report.steps.append(step)
        self.on_step(step)


def _prepare(launcher: Launcher, probe: RunSpec, secrets: RunSecrets, store: ObjectStore) -> str:
    store.put_bytes(layout.spec_key(probe.run_id), probe.to_json().encode())
    launcher.prepare(probe, secrets, store)  # the flavors, the token, then the code bundle into the bucket
    return f"under {layout.run_prefix(probe.run_id)}"


def smoke_spec(spec: RunSpec) -> RunSpec:
    """The user's run as the smoke test submits it: its own run id, one cheap job, the shortest timeout."""
    data = spec.model_dump()
    data["run_id"] = f"smoke-{token_hex(4)}"
    data["compute"].update(replica_flavor=SMOKE_FLAVOR, replicas=1, timeout=SMOKE_TIMEOUT)
    data["parent"] = None
    return RunSpec.model_validate(data, context={"stored": True})


def _clean_up(store: ObjectStore, run_id: str) -> None:
    """Delete whatever the test wrote to the bucket; a bucket that refused the test has nothing of it to delete."""
    try:
        store.delete_prefix(layout.run_prefix(run_id))
    except StoreError as error:
        log.warning("could not delete the smoke test's objects under %s: %s", layout.run_prefix(run_id), error)


def _job_report(job: JobHandle, secrets: RunSecrets) -> list[Step]:
    """The steps the job reports on `/health` (jobs/smoke.py, `report_body`)."""
    assert job.endpoint is not None, "a job answers the report once it is ready, at its endpoint"
    answer = requests.get(
        job.endpoint.rstrip("/") + "/health",
        headers={"Authorization": f"Bearer {secrets.replica_token}"},
        timeout=30,
    )
    answer.raise_for_status()
    return [Step(**step) for step in answer.json()["steps"]]


def _read_and_delete(store: ObjectStore, key: str) -> str:
    body = store.get_bytes(key)
    store.delete(key)
    return f"{len(body)} bytes at {key}"


def _money(usd: float | None) -> str:
    """A smoke test costs fractions of a cent: say so rather than print $0.0000."""
    if usd is None:
        return "an unknown amount (the Hub listed no price for the flavor)"
    return "less than $0.0001" if usd < 0.0001 else f"${usd:.4f}"


def _why(error: Exception) -> str:
    tail = getattr(error, "log_tail", "")
    last = tail.strip().splitlines()[-3:] if tail else []
    return " | ".join([str(error), *last])[:1000]
