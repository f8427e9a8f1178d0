"""Every environment variable the jobs read, declared once: its name, what it does, its default, who sets it.

Code reads a variable through its `Variable` here rather than through `os.environ`, so this module is the whole list;
the README's table of variables is generated from it and the panel's (`python -m backend.settings`), and a test keeps
the two equal. Most of them the panel sets on the jobs it submits; the ones marked "you" tune a job by hand.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Variable:
    """One environment variable. An unset or empty variable reads as its `default`; `when_unset` documents what
    the code does instead when there is no default value to give."""

    name: str
    meaning: str
    default: str = ""
    when_unset: str = ""
    set_by: str = "you"
    secret: bool = False  # masked in every log line of a job (jobs.runtime.setup_logging)

    def get(self, environ: Mapping[str, str] | None = None) -> str | None:
        value = (os.environ if environ is None else environ).get(self.name, "").strip()
        return value or self.default or None

    def number(self, environ: Mapping[str, str] | None = None) -> float | None:
        """The value as a number; a value that is none says which variable to fix."""
        value = self.get(environ)
        if value is None:
            return None
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{self.name}={value!r} is not a number; unset it or give seconds, e.g. 300") from None

    def flag_help(self, what: str) -> str:
        """A command-line flag's help for a value this variable gives the default of."""
        return f"{what} (default: ${self.name}, else {self.default or self.when_unset})"

    def markdown_row(self) -> str:
        default = f"`{self.default}`" if self.default else self.when_unset or "—"
        return f"| `{self.name}` | {self.meaning} | {default} | {self.set_by} |"


PANEL = "the panel"
HF_TOKEN = Variable(
    "HF_TOKEN",
    "the user's Hub token: gated or private models, publishing, cancelling the run's own jobs",
    set_by=f"{PANEL} (a Job secret)",
    secret=True,
)
UPSTREAM_TOKEN = Variable(
    "UPSTREAM_TOKEN", "the bearer token the proxy sends to the replicas", set_by=f"{PANEL} (a Job secret)", secret=True
)
REPLICA_TOKEN = Variable(
    "REPLICA_TOKEN",
    "the bearer token a replica demands of every request",
    set_by=f"{PANEL} (a Job secret)",
    secret=True,
)
AWS_ACCESS_KEY_ID = Variable(
    "AWS_ACCESS_KEY_ID", "bucket key id (S3, R2, MinIO, HF buckets)", set_by=f"{PANEL} (a Job secret)"
)
AWS_SECRET_ACCESS_KEY = Variable(
    "AWS_SECRET_ACCESS_KEY", "bucket secret key", set_by=f"{PANEL} (a Job secret)", secret=True
)
AWS_SESSION_TOKEN = Variable(
    "AWS_SESSION_TOKEN", "bucket session token, for temporary keys", set_by=f"{PANEL} (a Job secret)", secret=True
)
STORE_ENDPOINT = Variable("STORE_ENDPOINT", "the bucket's S3 endpoint, when it is not AWS", set_by=PANEL)
STORE_REGION = Variable("STORE_REGION", "the bucket's region", set_by=PANEL)
JOB_ID = Variable("JOB_ID", "this job's id on HF Jobs (the smoke test reports it)", set_by="HF Jobs")
TRAINER_WORKDIR = Variable(
    "GRPO_TRAINER_WORKDIR",
    "the trainer's local working folder, the same for every rank",
    when_unset="a temporary folder",
)
REPLICA_LOSS_TIMEOUT = Variable(
    "GRPO_REPLICA_LOSS_TIMEOUT", "seconds with no healthy replica before the trainer fails the run", "180"
)
STORE_OUTAGE_TIMEOUT = Variable(
    "GRPO_STORE_OUTAGE_TIMEOUT", "seconds the bucket may fail every call before the trainer stops the run", "300"
)
STORE_READ_TIMEOUT = Variable(
    "GRPO_STORE_READ_TIMEOUT", "seconds a bucket call waits for an answer before it is retried", "60"
)
TORCH_THREADS = Variable("GRPO_TORCH_THREADS", "CPU threads for torch in the trainer", when_unset="torch's own choice")
MODEL_CACHE = Variable(
    "GRPO_MODEL_CACHE", "where the built-in demo model is built and kept", "~/.cache/grpo-panel/models"
)
WANDB_API_KEY = Variable(
    "WANDB_API_KEY",
    "the W&B key the trainer reports with (wandb reads it), when the run reports to W&B",
    set_by=f"{PANEL} (a Job secret)",
    secret=True,
)
# Read by Trackio and wandb themselves; a local run's jobs inherit them from the panel.
TRACKIO_DIR = Variable(
    "TRACKIO_DIR",
    "where a local run's Trackio project is written (Trackio reads it)",
    when_unset="~/.cache/huggingface/trackio",
)
WANDB_MODE = Variable("WANDB_MODE", "`offline`: W&B runs are kept on disk only (wandb reads it)", when_unset="online")
WANDB_DIR = Variable("WANDB_DIR", "where wandb writes its run folders (wandb reads it)", when_unset="the working dir")
VLLM_PYTHON = Variable(
    "GRPO_VLLM_PYTHON",
    "the Python with vLLM's CPU build, which a replica without a GPU runs vLLM with (compute.engine: vllm)",
    when_unset="`.venv-vllm` of this checkout (`scripts/setup vllm`)",
)
FAULT_SERVE_PREVIOUS_ADAPTER = Variable(
    "GRPO_FAULT_SERVE_PREVIOUS_ADAPTER",
    "fault injection for the policy-audit tests: a replica serves an adapter's previous version",
    set_by="tests",
)

JOB_VARIABLES = (
    HF_TOKEN,
    UPSTREAM_TOKEN,
    REPLICA_TOKEN,
    AWS_ACCESS_KEY_ID,
    AWS_SECRET_ACCESS_KEY,
    AWS_SESSION_TOKEN,
    STORE_ENDPOINT,
    STORE_REGION,
    JOB_ID,
    TRAINER_WORKDIR,
    REPLICA_LOSS_TIMEOUT,
    STORE_OUTAGE_TIMEOUT,
    STORE_READ_TIMEOUT,
    TORCH_THREADS,
    MODEL_CACHE,
    VLLM_PYTHON,
    WANDB_API_KEY,
    TRACKIO_DIR,
    WANDB_MODE,
    WANDB_DIR,
    FAULT_SERVE_PREVIOUS_ADAPTER,
)
SECRET_VARIABLES = tuple(variable.name for variable in JOB_VARIABLES if variable.secret)
# What a user sets by hand to tune a job: a local job inherits these from the panel's environment.
TUNING_VARIABLES = tuple(variable for variable in JOB_VARIABLES if variable.set_by == "you")
