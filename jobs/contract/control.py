"""Control files in the store: how the launcher, the proxy and the trainer coordinate without talking directly.

- `control/upstreams.json` (launcher → proxy): the replicas' base URLs; the proxy watches it.
- `control/jobs.json` (launcher → trainer): which jobs serve the run, so the trainer can stop them when it ends.
- `control/stop.json` (panel → trainer): a graceful stop request; the trainer saves and exits.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field

UPSTREAMS = "upstreams"
JOBS = "jobs"
STOP = "stop"


class Upstream(BaseModel):
    role: str  # replica-<i>
    url: str


class UpstreamsRecord(BaseModel):
    replicas: list[Upstream]
    updated: float = Field(default_factory=time.time)


class JobRef(BaseModel):
    role: str
    job_id: str  # HF Jobs id, or the local process group id as text
    pgid: int | None = None  # local jobs only


class JobsRecord(BaseModel):
    backend: Literal["local", "hf_jobs"]
    namespace: str | None = None
    jobs: list[JobRef]


class StopRequest(BaseModel):
    reason: str = "stopped from the panel"
    requested: float = Field(default_factory=time.time)
