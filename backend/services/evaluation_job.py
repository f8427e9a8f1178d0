"""Held-out evaluation on HF Jobs, for a run whose model this machine cannot serve.

One job of the replicas' kind (their image and flavor, no port) runs `jobs.evaluation.after_run`: it reads what it is
asked from the run's bucket, evaluates, stores each result and ends. The panel waits for it, cancels it if it is asked
to stop or overruns (it never keeps billing past the evaluation), deletes the request, and says what the job cost.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from secrets import token_hex

from backend.context import PanelContext
from backend.database.models import Run
from backend.launchers.base import EVALUATOR_ROLE, TERMINAL, JobHandle, JobState, Launcher
from jobs.contract import RunSpec, duration, layout, timeout_seconds
from jobs.store import ObjectStore, StoreError


class EvaluationJobError(RuntimeError):
    """The evaluator job failed, was cancelled or overran; the message says which, with its log's last lines."""


@dataclass(frozen=True)
class EvaluationJobReport:
    url: str | None
    flavor: str
    seconds: float  # how long it ran (queueing not counted: not billed)
    cost_usd: float | None  # None: the Hub lists no price for the flavor

    def summary(self) -> str:
        cost = "an unknown amount" if self.cost_usd is None else f"${self.cost_usd:.4f}"
        return f"one {self.flavor} job ran {duration(self.seconds)} and cost {cost}"


def run_evaluation_job(
    ctx: PanelContext,
    run: Run,
    spec: RunSpec,
    versions: list[int],
    on_progress: Callable[[str], None] = lambda message: None,
    cancelled: Callable[[], bool] = lambda: False,
) -> EvaluationJobReport:
    """Evaluate `versions` of `run` with `spec` (the run's, its eval settings perhaps changed) in one job; the
    results are in the bucket when this returns."""
    launcher, secrets, store = ctx.launcher_for(run), ctx.secrets_for(run), ctx.store_for(run)
    request = token_hex(4)
    key = layout.eval_request_key(run.id, request)
    store.put_bytes(key, json.dumps({"spec": spec.model_dump(mode="json"), "versions": versions}).encode())
    try:
        launcher.prepare(spec, secrets, store)  # the code bundle the job starts from
        job = launcher.start_job(spec, EVALUATOR_ROLE + request, secrets)
    except BaseException:
        _delete(store, key)
        raise
    price = launcher.price_per_hour(spec.compute.replica_flavor)
    rate = f"${price:.2f}/h" if price is not None else "a price the Hub does not list"
    on_progress(
        f"evaluating {len(versions)} version(s) on one {spec.compute.replica_flavor} job at {rate}, ending with the "
        f"last version (at most compute.timeout, {spec.compute.timeout}): {job.url}"
    )
    try:
        state = _wait_for_end(launcher, job, spec, on_progress, cancelled)
    finally:
        launcher.end(job)
        _delete(store, key)
    flavor = spec.compute.replica_flavor
    report = EvaluationJobReport(job.url, flavor, state.ran_seconds, launcher.cost_usd(flavor, state))
    if state.stage != "completed":
        tail = " | ".join(launcher.logs(job, 5))
        raise EvaluationJobError(
            f"the evaluator job ended {state.stage}{f' ({state.message})' if state.message else ''}; "
            f"{report.summary()}; its log ends: {tail or 'nothing'}; see {job.url}"
        )
    return report


def _wait_for_end(
    launcher: Launcher,
    job: JobHandle,
    spec: RunSpec,
    on_progress: Callable[[str], None],
    cancelled: Callable[[], bool],
) -> JobState:
    """The job's state once it has ended; raises when it is to be cancelled (asked, or past the run's timeout: the
    Hub's own timeout would end it then too)."""
    started = time.monotonic()
    deadline = started + timeout_seconds(spec.compute.timeout)
    stage = ""
    while (state := launcher.state(job)).stage not in TERMINAL:
        if cancelled():
            raise EvaluationJobError(f"the evaluation was cancelled; its job {job.url} is cancelled too")
        if time.monotonic() > deadline:
            raise EvaluationJobError(
                f"the evaluator job ran past compute.timeout ({spec.compute.timeout}) and was cancelled; evaluate "
                "fewer versions at a time, or raise compute.timeout"
            )
        if state.stage != stage:
            stage = state.stage
            on_progress(f"evaluator job {stage} ({duration(time.monotonic() - started)} since it was submitted)")
        time.sleep(launcher.poll_interval)
    return state


def _delete(store: ObjectStore, key: str) -> None:
    try:
        store.delete(key)
    except StoreError:
        pass  # a request left behind is a few hundred bytes that nothing reads again
