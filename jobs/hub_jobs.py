"""Calls to HF Jobs that the panel and the trainer both make, so both handle the Hub's answers the same way."""

from __future__ import annotations

from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError

ENDED_STAGES = frozenset({"COMPLETED", "ERROR", "CANCELED", "DELETED"})


def cancel_unless_ended(api: HfApi, job_id: str, namespace: str | None) -> None:
    """Cancel a job; a job that has already ended counts as cancelled.

    Whether the Hub accepts a cancel of an ended job is not documented; a refusal (4xx) for a job that has ended is
    no failure to stop it. Any other refusal is raised."""
    try:
        api.cancel_job(job_id=job_id, namespace=namespace)
    except HfHubHTTPError as error:
        status = error.response.status_code if error.response is not None else None
        if status is None or not 400 <= status < 500 or status == 429:
            raise
        info = api.inspect_job(job_id=job_id, namespace=namespace)
        if not (info.status and info.status.stage in ENDED_STAGES):
            raise
