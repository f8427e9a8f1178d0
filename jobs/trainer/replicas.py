"""The trainer stops its own replicas when it ends, so no GPU keeps billing after training.

The launcher records the run's jobs in `control/jobs.json`; the trainer reads it and cancels the replicas with the
means it has: the HF token it was given (HF Jobs), or the process groups (local).
"""

from __future__ import annotations

import logging
import os

from jobs.contract import layout
from jobs.contract.control import JOBS, JobsRecord
from jobs.processes import terminate_group
from jobs.runtime import ENV_HF_TOKEN
from jobs.store import ObjectNotFound, ObjectStore

log = logging.getLogger(__name__)


def stop_replicas(store: ObjectStore, run_id: str, reason: str) -> list[str]:
    """Cancel every replica job of the run; returns the roles it stopped. Never raises: it runs on the way out."""
    try:
        record = JobsRecord.model_validate_json(store.get_bytes(layout.control_key(run_id, JOBS)))
    except ObjectNotFound:
        log.info("no control/jobs.json: the launcher manages the replicas")
        return []
    except Exception as error:
        log.error("cannot read the replica list (%s); the launcher must stop them", error)
        return []
    stopped = []
    for job in record.jobs:
        if not job.role.startswith("replica-"):
            continue
        try:
            if record.backend == "local" and job.pgid:
                terminate_group(job.pgid)
            elif record.backend == "hf_jobs":
                from huggingface_hub import HfApi

                HfApi(token=os.environ.get(ENV_HF_TOKEN)).cancel_job(job_id=job.job_id, namespace=record.namespace)
            stopped.append(job.role)
        except Exception as error:
            log.error("could not stop %s (%s): %s", job.role, job.job_id, error)
    log.info("stopped replicas %s: %s", ", ".join(stopped) or "none", reason)
    return stopped
