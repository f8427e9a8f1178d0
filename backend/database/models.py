"""The panel's SQLite tables.

SQLite holds what the panel has read from the store and the launchers, so pages render without touching the bucket.
Every user-visible row carries its `owner`, and every query a service makes filters on it. Time columns are seconds
since the epoch as the writer's clock reported them; nothing compares clocks across machines for correctness.
"""

from __future__ import annotations

import json

from sqlalchemy import Column, Index, LargeBinary, UniqueConstraint
from sqlmodel import Field, SQLModel

from backend.database.turns import Turn, read_turns

# The statuses of a run that has ended, the last three of `Run.status`: the trainer's phase that ends a run becomes its
# status (backend/ingestion/run_status.py).
TERMINAL_STATUSES = ("finished", "failed", "stopped")


class Run(SQLModel, table=True):
    id: str = Field(primary_key=True)  # the run id of its spec
    owner: str = Field(index=True)
    name: str = ""
    # draft, launching, running, degraded, stalled, stopping, finished, failed, stopped
    status: str = "draft"
    status_message: str = ""
    spec_json: str
    storage_uri: str
    backend: str
    parent_run_id: str | None = Field(default=None, index=True)
    parent_version: int | None = None
    store_credential_id: int | None = None  # the bucket keys this run uses (None: a local folder)
    # The bearer token local replicas demand, encrypted like every credential; kept so a relaunched trainer can
    # still talk to the replicas it did not start.
    replica_token_ciphertext: bytes | None = Field(default=None, sa_column=Column(LargeBinary, nullable=True))
    hf_credential_id: int | None = None  # the HF token its jobs get (None: local runs on public models)
    wandb_credential_id: int | None = None  # the W&B key its trainer reports with (None: no W&B)
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    stop_requested_at: float | None = None
    step: int = 0
    max_steps: int = 0
    latest_reward: float | None = None
    current_version: int | None = None  # alias "current": what adapters/CURRENT names
    best_version: int | None = None  # alias "best": the highest held-out reward, else the highest smoothed reward
    cost_usd: float = 0.0
    last_telemetry_at: float | None = None  # panel clock when telemetry last arrived (stall detection)


class Job(SQLModel, table=True):
    __table_args__ = (UniqueConstraint("run_id", "role", "attempt"),)
    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(foreign_key="run.id", index=True)
    owner: str = Field(index=True)
    role: str  # trainer, replica-0, replica-1, ...
    attempt: int = 1  # a relaunched trainer is a new attempt (numbered like the trainer's own attempts)
    backend_job_id: str = ""
    stage: str = "scheduling"  # scheduling, running, completed, error, canceled
    url: str | None = None  # the job's page
    endpoint: str | None = None  # a replica's base URL once exposed
    flavor: str = ""
    price_per_hour: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    log_tail: str = ""
    message: str = ""


VERSION_REWARD_STEPS = 5  # a version's reward: the mean over the steps up to its own (one step's is noisy)


class AdapterVersion(SQLModel, table=True):
    __table_args__ = (UniqueConstraint("run_id", "version"),)
    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(foreign_key="run.id", index=True)
    owner: str = Field(index=True)
    version: int
    step: int | None = None
    created_at: float
    size_bytes: int = 0
    manifest_json: str = "{}"
    reward: float | None = None  # mean reward of the `VERSION_REWARD_STEPS` steps up to `step`, filled by the poller
    audit_max_diff: float | None = None  # largest log-prob difference the policy audit saw across replicas
    audit_ok: bool | None = None
    attempt: int | None = None


class MetricPoint(SQLModel, table=True):
    __table_args__ = (Index("ix_metric_run_name_step", "run_id", "name", "step"),)
    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(foreign_key="run.id")
    owner: str
    step: int
    name: str
    value: float
    time: float | None = None
    attempt: int = 1  # the trainer attempt that logged it (a resumed run supersedes what a lost attempt logged)


class RolloutSample(SQLModel, table=True):
    # One index: sample pages are step ranges (a reward filter within them is cheap), and every extra index slows the
    # poller's bulk inserts.
    __table_args__ = (Index("ix_sample_run_step", "run_id", "step"),)
    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(foreign_key="run.id")
    owner: str
    step: int  # the optimizer step that consumed it
    policy_version: int  # the adapter version that generated it
    staleness: int
    group_id: int
    prompt: str
    completion: str
    reward: float | None = None
    rewards_json: str = "{}"  # score per reward function
    advantage: float = 0.0
    dropped: bool = False  # pulled by the trainer but discarded as too stale
    time: float | None = None
    attempt: int = 1
    turns_json: str | None = None  # an agent's episode turn by turn (backend/database/turns.py); None: a single reply

    @property
    def turns(self) -> list[Turn] | None:
        """The episode turn by turn, decoded from `turns_json` (checked when ingested); None for a single reply."""
        return read_turns(self.turns_json)

    @property
    def rewards(self) -> dict[str, float | None]:
        """The score per reward function, decoded from `rewards_json` as ingest stored it (None: a score that was not
        a finite number)."""
        rewards: dict[str, float | None] = json.loads(self.rewards_json or "{}")
        return rewards


class VersionScore(SQLModel, table=True):
    """One held-out score of one adapter version (telemetry stream `eval`): the mean over the evaluation's prompts
    with its 95 % interval. `key` names the evaluation settings, so a version scored again under other settings (an
    after-run evaluation with more prompts) gets rows beside the run's own, never over them."""

    __table_args__ = (UniqueConstraint("run_id", "version", "key", "name"),)
    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(foreign_key="run.id", index=True)
    owner: str
    version: int  # 0: the base model
    step: int  # the optimizer step the version holds (0 for the base model)
    key: str  # hash of the evaluation settings
    name: str  # reward (the weighted total, as TRL's training metric) or rewards/<reward name>
    mean: float
    low: float | None = None  # the interval's bounds; None: unbounded (e.g. a single prompt)
    high: float | None = None
    pass_at_k: float | None = None  # only where every score is 0 or 1
    prompts: int = 0
    k: int = 0  # samples per prompt
    time: float


class ProxySnapshot(SQLModel, table=True):
    __table_args__ = (Index("ix_proxy_run_order", "run_id", "id"),)
    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(foreign_key="run.id")
    owner: str
    time: float
    stats_json: str


class ReplicaStatus(SQLModel, table=True):
    """The latest heartbeat of each replica (and of the trainer), replaced as new ones arrive."""

    __table_args__ = (UniqueConstraint("run_id", "role"),)
    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(foreign_key="run.id", index=True)
    owner: str
    role: str
    time: float
    data_json: str


class Event(SQLModel, table=True):
    """Alerts and notable happenings, shown as banners and in a run's history."""

    __table_args__ = (Index("ix_event_run_time", "run_id", "time"),)
    id: int | None = Field(default=None, primary_key=True)
    run_id: str | None = Field(default=None, foreign_key="run.id")
    owner: str = Field(index=True)
    time: float
    level: str = "info"  # info, warning, error
    kind: str  # e.g. kl_drift, replica_lag, stalled, job_error, cost_cap
    message: str
    active: bool = True  # an alert still in force
    step: int | None = None  # the run's step when it was raised
    cleared_at: float | None = None  # when its condition ended (an alert) or it was dismissed
    dismissed: bool = False  # put away by its owner rather than cleared by the run


class PollCursor(SQLModel, table=True):
    """Where the poller stopped reading a stream, so a restarted panel continues exactly there."""

    run_id: str = Field(primary_key=True, foreign_key="run.id")
    stream: str = Field(primary_key=True)  # metrics, samples, events, proxy, eval, adapters, audit
    cursor: str = ""  # the last store key ingested
    updated_at: float = 0.0


class ResumePoint(SQLModel, table=True):
    """A trainer attempt that resumed from a checkpoint: what earlier attempts logged past that step is superseded.

    Kept as a row, not only applied once, because the records it supersedes may still be on their way: a poller that
    reads a long backlog in several passes meets the resume event before some of the dead attempt's later chunks.
    """

    run_id: str = Field(primary_key=True, foreign_key="run.id")
    attempt: int = Field(primary_key=True)
    resumed_from_step: int


class Launch(SQLModel, table=True):
    """A run's launch, step by step, so that a panel that dies mid-launch leaves something another panel can finish.

    The panel driving the launch (`holder`) renews `renewed_at` while it works; a launch that is not done and has not
    been renewed for a while is taken over by whichever panel notices first (compare-and-set on holder and
    `renewed_at`), which finds the jobs already started by their labels and goes on from there.
    """

    run_id: str = Field(primary_key=True, foreign_key="run.id")
    owner: str
    # preparing, replicas, healthy, trainer, done, failed, cancelled
    step: str = "preparing"
    holder: str = ""  # the panel process driving it: host:pid:nonce
    renewed_at: float = 0.0
    takeovers: int = 0  # how many times another panel took over after the holder stopped renewing
    updated_at: float = 0.0
    message: str = ""


class Credential(SQLModel, table=True):
    """A secret entered once; stored encrypted, shown masked, handed to launchers as Job secrets only."""

    __table_args__ = (UniqueConstraint("owner", "name"),)
    id: int | None = Field(default=None, primary_key=True)
    owner: str = Field(index=True)
    name: str
    kind: str  # hf_token, s3
    ciphertext: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    masked: str  # e.g. "hf_…x3Fq" — all the UI ever shows
    created_at: float
