"""The trainer stops its own replicas when it ends, so no GPU keeps billing after training.

The launcher records the run's jobs in `control/jobs.json`; the trainer reads it and cancels the replicas with the
means it has: the HF token it was given (HF Jobs), or the process groups (local).
"""

from __future__ import annotations

import logging
import threading

from jobs import settings
from jobs.contract import layout
from jobs.contract.control import JOBS, JobsRecord
from jobs.processes import terminate_group
from jobs.store import ObjectNotFound, ObjectStore

log = logging.getLogger(__name__)


def read_replica_jobs(store: ObjectStore, run_id: str) -> JobsRecord | None:
    """The run's jobs as the launcher recorded them (None if it keeps no record: it then stops the replicas itself)."""
    try:
        return JobsRecord.model_validate_json(store.get_bytes(layout.control_key(run_id, JOBS)))
    except ObjectNotFound:
        log.info("no control/jobs.json: the launcher manages the replicas")
        return None


def stop_replicas(store: ObjectStore, run_id: str, reason: str, known: JobsRecord | None = None) -> list[str]:
    """Cancel every replica job of the run; returns the roles it stopped. Never raises: it runs on the way out.

    The record is read again (a replaced replica is a new job); when the bucket cannot be read (the run may be ending
    because of that), the replicas `known` from the trainer's start are stopped instead.
    """
    try:
        record = read_replica_jobs(store, run_id)
    except Exception as error:
        log.error("cannot read the replica list (%s); stopping the replicas known at start", error)
        record = known
    if record is None:
        return []
    stopped = []
    for job in record.jobs:
        if not job.role.startswith("replica-"):
            continue
        try:
            if record.backend == "local" and job.pgid:
                terminate_group(job.pgid)
            elif record.backend == "hf_jobs":
                cancel_hf_job(job.job_id, record.namespace)
            stopped.append(job.role)
        except Exception as error:
            log.error("could not stop %s (%s): %s", job.role, job.job_id, error)
    log.info("stopped replicas %s: %s", ", ".join(stopped) or "none", reason)
    return stopped


CANCEL_TIMEOUT = 60.0  # seconds one cancel may take: huggingface_hub's client has no timeout of its own


def cancel_hf_job(job_id: str, namespace: str | None) -> None:
    """Cancel an HF job, giving up after CANCEL_TIMEOUT (the call goes on in a daemon thread): a stuck request must
    not keep the trainer from stopping its other replicas and exiting."""
    from huggingface_hub import HfApi

    from jobs.hub_jobs import cancel_unless_ended

    errors: list[BaseException] = []

    def cancel() -> None:
        try:
            cancel_unless_ended(HfApi(token=settings.HF_TOKEN.get()), job_id, namespace)
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=cancel, name=f"cancel-{job_id}", daemon=True)
    thread.start()
    thread.join(CANCEL_TIMEOUT)
    if thread.is_alive():
        raise TimeoutError(f"the Hub did not answer the cancel within {CANCEL_TIMEOUT:.0f}s")
    if errors:
        raise errors[0]
