"""The shapes of what jobs write to a run's store, as the poller reads it back, and of the rows made of it.

A record crosses from a job as JSON: `JsonRecord` until it is given its shape, once, where it is read (the row builders
of backend/ingestion/ingest.py, the poller's parts). A shape says what a well-behaved writer puts there (named beside
each), as far as the panel reads it; nothing is validated when a record is given one, since a job may send anything,
so the code reading a field still checks or coerces it. Every key is optional (total=False): a reader takes each with
a default. Where the writer declares its record's shape itself, the panel reads it in that shape instead of one from
here: the evaluation's (jobs/evaluation/results.py, `EvalRecord`), the policy audit's (jobs/trainer/audit.py,
`AuditRecord`), the proxy's snapshots (jobs/proxy/stats.py, `ProxySnapshot`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict

JsonRecord = Mapping[str, object]  # one record as decoded from a job's JSON, before it is given its shape


class MetricRecord(TypedDict, total=False):
    """`telemetry/metrics`, one per logged step (jobs/trainer/telemetry.py), and beside these keys one number per
    metric TRL logged, under its name: read by iterating the items (a TypedDict cannot name them)."""

    step: int
    time: float
    attempt: int


class SampleRecord(TypedDict, total=False):
    """`telemetry/samples`, one per rollout sample the trainer pulled (jobs/trainer/telemetry.py)."""

    step: int
    time: float
    attempt: int
    policy_version: int
    staleness: int
    dropped: bool
    group_id: int
    prompt: str
    completion: str
    turns: list[dict[str, object]] | None  # an agent's episode, checked turn by turn (backend/ingestion/episodes.py)
    reward: float | None
    rewards: dict[str, float | None]
    advantage: float


class EventRecord(TypedDict, total=False):
    """`telemetry/events` (jobs/trainer/telemetry.py, `TrainerTelemetry.event`), with any fields of its kind."""

    time: float
    attempt: int
    kind: str
    level: str
    message: str
    resumed_from_step: int  # on a `resume` event


class StatusRecord(TypedDict, total=False):
    """`status/<role>.json`, rewritten by each job (jobs/runtime.py `write_status`); the trainer's also says where
    training is (jobs/trainer/telemetry.py), a replica's its heartbeat (jobs/replica/heartbeat.py)."""

    time: float
    phase: str  # the trainer's: starting, waiting_replicas, training, evaluating, saving, finished, failed, stopped
    step: int
    last_error: str | None


# --- what the row builders make of them: one SQLite row each -----------------------------------------------------


class MetricRow(TypedDict):
    run_id: str
    owner: str
    step: int
    name: str
    value: float
    time: float | None
    attempt: int


class SampleRow(TypedDict):
    run_id: str
    owner: str
    step: int
    policy_version: int
    staleness: int
    group_id: int
    prompt: str
    completion: str
    reward: float | None
    rewards_json: str
    advantage: float
    dropped: bool
    time: float | None
    attempt: int
    turns_json: str | None


class EvalColumns(TypedDict):
    """What an eval record's scores share: which version, under which settings."""

    run_id: str
    owner: str
    version: int
    step: int
    key: str
    prompts: int
    k: int
    time: float


class EvalRow(EvalColumns):
    name: str
    mean: float
    low: float | None
    high: float | None
    pass_at_k: float | None
