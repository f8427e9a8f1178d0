"""Runs as the tests drive them: the demo on the Hub Jobs emulator, and following a run to its end."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from backend.database.models import TERMINAL_STATUSES, Run
from backend.ingestion.poller import Poller
from backend.services.runs import RunService
from jobs.contract import RunSpec
from jobs.demo.preset import demo_spec
from tests.support.waiting import wait_until


def hub_demo_spec(
    run_id: str, bucket: str, endpoint: str, namespace: str, steps: int = 5, save_steps: int = 50, **compute: Any
) -> RunSpec:
    """The embedded demo on (emulated) Hugging Face Jobs, its bucket on the S3 server at `endpoint`."""
    uri = f"s3://{bucket}/panel"
    return demo_spec(
        run_id,
        uri,
        grpo={"max_steps": steps, "save_steps": save_steps},
        compute={
            "backend": "hf_jobs",
            "namespace": namespace,
            "trainer_flavor": "cpu-upgrade",
            "replica_flavor": "cpu-basic",
            "timeout": "30m",
            **compute,
        },
        storage={"uri": uri, "endpoint": endpoint},
    )


def follow_to_end(poller: Poller, runs: RunService, run_id: str, timeout: float, interval: float = 1.0) -> Run:
    """Poll the run until it ends (finished, failed or stopped); the run as it ended."""

    def ended() -> Run | None:
        poller.poll_run(run_id)
        run = runs.get(run_id)
        return run if run.status in TERMINAL_STATUSES else None

    return wait_until(ended, timeout, interval, what=f"the end of {run_id}")


def job_log_tails(folder: Path, lines: int = 30) -> str:
    """The last `lines` lines of every job's log in the local launcher's folder of a run: what a failed wait prints
    so that a hang seen once in CI can be diagnosed from its report alone."""
    tails = []
    for log in sorted(folder.glob("*/log")):
        text = log.read_text(errors="replace").splitlines()[-lines:]
        tails.append(f"--- {log.parent.name} ---\n" + "\n".join(text))
    return "\n".join(tails)


def wait_while_running(
    poller: Poller, runs: RunService, run_id: str, reached: Callable[[], Any], timeout: float, what: str, folder: Path
) -> Any:
    """Wait until `reached()` is truthy while the run goes on; fail at once if the run ends first, and on either
    failure say why with the tails of the jobs' logs."""

    def check() -> Any:
        if value := reached():
            return value
        poller.poll_run(run_id)
        run = runs.get(run_id)
        if run.status in TERMINAL_STATUSES:
            raise AssertionError(
                f"{run_id} ended ({run.status}: {run.status_message}) before {what}\n{job_log_tails(folder)}"
            )
        return None

    try:
        return wait_until(check, timeout, 1.0, what=what)
    except TimeoutError as error:
        raise AssertionError(f"{error}\n{job_log_tails(folder)}") from None
