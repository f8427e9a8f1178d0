"""The run specification: everything a run needs, validated once, shared by the panel and every job.

A `RunSpec` is written to the store as `spec.json` and read back by the trainer and the replicas, so it must
round-trip through JSON exactly and must never hold a secret (credentials travel as Job secrets or environment).
Defaults follow the public recipe (Qwen2.5-Math-1.5B, LoRA r=1 all-linear, 8 generations, lr 4e-5, max staleness 4,
weight sync every 4 steps, a checkpoint every 50 steps).

Validation errors name the field and say how to fix it; `parse_spec` turns pydantic's errors into `SpecError`, whose
`errors` map dotted field names to messages so a form can show each one next to its field.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from jobs.contract.durations import timeout_seconds
from jobs.contract.flavors import FLAVORS, flavor
from jobs.contract.storage_uri import parse_storage_uri
from jobs.secrets import find_secret

SCHEMA_VERSION: Literal[1] = 1
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
MAX_REPLICAS = 16
# Why top-p and top-k stay off: the replicas' log-probs would be those of the truncated, renormalised distribution.
_NO_TRUNCATION = (
    "which TRL 1.16 does not model: the replicas' log-probs would come from the truncated distribution and the "
    "importance ratio would be wrong"
)
# The shortest job timeout that makes sense on HF Jobs (a timeout written "2.5" would be 2 seconds).
MIN_HUB_TIMEOUT_S = 600
# vLLM holds max_staleness + 2 adapters at once; beyond this they crowd out the KV cache for no gain.
MAX_STALENESS = 16
# What an empty in-flight or queue limit means (jobs/contract/derived.py: `rollout_limits`).
_AUTO_LIMIT = "auto: what the staleness window can take"
RUN_ID_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]{1,46}[a-z0-9]$")
DEMO_MODEL_ID = "builtin:tiny-qwen2"
AGENT_DEMO_MODEL_ID = "builtin:tiny-agent"  # the tiny model warm-started to call a tool (jobs/demo/agent_model.py)
BUILTIN_MODELS = (DEMO_MODEL_ID, AGENT_DEMO_MODEL_ID)
DEMO_DATASET_ID = "digits"
AGENT_DEMO_DATASET_ID = "codebook"
BUILTIN_DATASETS = (DEMO_DATASET_ID, AGENT_DEMO_DATASET_ID)
# Built-in rewards and the parameters each accepts (implementations live in jobs.trainer.rewards).
BUILTIN_REWARDS: dict[str, frozenset[str]] = {
    "math_boxed": frozenset(),
    "format": frozenset({"tags"}),
    "length": frozenset({"target"}),
    "regex": frozenset({"pattern"}),
    "digit_frac": frozenset(),
    "exact_answer": frozenset(),
}
MAX_REWARD_SOURCE_BYTES = 200_000
# Environments an agent run can use without code of its own (jobs/environments): each one's tools.
BUILTIN_ENVIRONMENTS: dict[str, str] = {
    "calculator": "calculate(expression): the value of an arithmetic expression",
    "python": "run_python(code): what a Python program prints, run confined (no network, no processes)",
    "codebook": "lookup(name): the code each row keeps for the thing it asks about (the agent demo's)",
}
MAX_TURNS = 32  # tool-calling turns per episode: each re-sends the whole conversation
MAX_ENVIRONMENT_PACKAGES = 16
_PINNED_PACKAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9,._-]+\])?==[A-Za-z0-9][A-Za-z0-9.+!_-]*$")
# Upper bounds on form values that are otherwise accepted and only fail once jobs run (or when the run is recorded).
MAX_DATASET_ROWS = 1_000_000_000
MAX_SYSTEM_PROMPT_CHARS = 100_000  # sent with every prompt: beyond this it crowds out any model's context
MAX_STEPS = 10_000_000  # the panel records max_steps as a 64-bit integer; no run comes near this
MAX_SEED = 2**32 - 1  # NumPy (seeded by the trainer through transformers.set_seed) refuses larger seeds
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?$")
_NAMED_FIELD = re.compile(r"^([a-z_][\w.\[\]]*): (.+)$", re.S)


class SpecError(ValueError):
    """A spec that does not validate. `errors` maps a dotted field name to what is wrong and how to fix it."""

    def __init__(self, errors: dict[str, str]):
        self.errors = errors
        super().__init__("; ".join(f"{field}: {message}" for field, message in errors.items()))


def shown(
    label: str,
    section: str,
    help: str = "",
    *,
    advanced: bool = False,
    unset: str = "",
    choices: dict[str, str] | None = None,
) -> Any:
    """A field's place on the panel's Launch form, which is generated from these (app/launch_form.py).

    `label` names the field on the form and in every error about it; `section` is the part of the form it sits in
    (and whose note shows its errors): run, model, dataset, storage, compute, training or reporting; `advanced` folds
    it into the Advanced settings. `unset` says what an empty optional value means ("auto", "all rows"): a number box
    shows it as 0. `choices` gives a literal's values their words.
    """
    form: dict[str, Any] = {"section": section, "advanced": advanced}
    if unset:
        form["unset"] = unset
    if choices:
        form["choices"] = choices
    return Field(title=label, description=help or None, json_schema_extra={"form": form})


class _Section(BaseModel):
    # Unknown keys are errors, so a typo ("max_stalenes") is reported rather than silently ignored.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSpec(_Section):
    id: Annotated[
        str, shown("Model", "model", f"Hub id (owner/name), an absolute local path, or {' or '.join(BUILTIN_MODELS)}")
    ] = "Qwen/Qwen2.5-Math-1.5B"
    revision: Annotated[
        str | None, shown("Revision", "model", "a branch, tag or commit; empty: main", advanced=True)
    ] = None
    max_model_len: Annotated[
        int,
        Field(ge=64, le=1_048_576),
        shown("Max model length", "model", "prompt and completion tokens", advanced=True),
    ] = 4096
    dtype: Annotated[Literal["auto", "bfloat16", "float16", "float32"], shown("Dtype", "model", advanced=True)] = (
        "bfloat16"
    )

    @field_validator("id")
    @classmethod
    def _model_id(cls, value: str) -> str:
        value = value.strip()
        if value in BUILTIN_MODELS or value.startswith("/"):
            return value
        if ".." in value or "--" in value or not _HUB_ID.match(value):
            raise ValueError(
                f"{value!r} is not a Hub model id; use 'owner/name' (e.g. 'Qwen/Qwen2.5-0.5B-Instruct'), "
                f"an absolute local path, or '{DEMO_MODEL_ID}' ('{AGENT_DEMO_MODEL_ID}' for agents) for a built-in "
                "demo model"
            )
        return value


class DatasetSpec(_Section):
    source: Annotated[
        Literal["hub", "store", "builtin"],
        shown(
            "Dataset source", "dataset", choices={"hub": "Hub", "store": "File in the bucket", "builtin": "Built-in"}
        ),
    ] = "hub"
    # A Hub dataset id, a JSONL/CSV/Parquet path relative to the store root, or a built-in dataset name.
    id: Annotated[
        str,
        shown("Dataset", "dataset", f"owner/name on the Hub, a path in the bucket, or {' or '.join(BUILTIN_DATASETS)}"),
    ] = "sail/Sanity-Test-R1D-1.5B"
    split: Annotated[str, shown("Split", "dataset")] = "train"
    prompt_column: Annotated[str, shown("Prompt column", "dataset")] = "prompt"
    answer_column: Annotated[
        str | None,
        shown("Answer column", "dataset", "passed to rewards as `answer`; a.b reaches into a struct column"),
    ] = "reward_model.ground_truth"
    system_prompt: Annotated[str | None, shown("System prompt", "dataset", "optional; sent before every prompt")] = None
    limit: Annotated[int | None, Field(ge=1), shown("Row limit", "dataset", unset="all rows")] = None

    @field_validator("limit")
    @classmethod
    def _limit(cls, value: int | None) -> int | None:
        if value is not None and value > MAX_DATASET_ROWS:
            raise ValueError(
                f"{value} rows is more than a dataset can hold here; use at most {MAX_DATASET_ROWS:,} "
                "or leave it empty to use every row"
            )
        return value

    @field_validator("system_prompt")
    @classmethod
    def _system_prompt(cls, value: str | None) -> str | None:
        if value is not None and len(value) > MAX_SYSTEM_PROMPT_CHARS:
            raise ValueError(
                f"{len(value):,} characters is too long: it is sent with every prompt; "
                f"keep it under {MAX_SYSTEM_PROMPT_CHARS:,} characters"
            )
        return value

    @model_validator(mode="after")
    def _dataset_id(self) -> DatasetSpec:
        if self.source == "hub" and (".." in self.id or not _HUB_ID.match(self.id)):
            raise ValueError(f"id: {self.id!r} is not a Hub dataset id; use 'owner/name'")
        if self.source == "store":
            if self.id.startswith("/") or ".." in self.id.split("/"):
                raise ValueError(f"id: {self.id!r} must be a path inside the store, e.g. 'datasets/train.jsonl'")
            if self.id.split("/", 1)[0] == "runs":  # layout.RUNS: every run's own data, possibly another owner's
                raise ValueError(
                    f"id: {self.id!r} is inside runs/, which holds the runs' own data; keep datasets elsewhere in "
                    "the store, e.g. 'datasets/train.jsonl'"
                )
            if not self.id.endswith((".jsonl", ".json", ".csv", ".parquet")):
                raise ValueError(f"id: {self.id!r} must end in .jsonl, .json, .csv or .parquet")
        if self.source == "builtin" and self.id not in BUILTIN_DATASETS:
            raise ValueError(
                f"id: {self.id!r} is not a built-in dataset; the built-in ones are {', '.join(BUILTIN_DATASETS)}"
            )
        return self


class RewardSpec(_Section):
    kind: Annotated[Literal["builtin", "code"], Field(title="Kind")] = "builtin"
    # Built-in name, or for code the name shown in metrics (`rewards/<name>`).
    name: Annotated[str, Field(title="Name")] = "math_boxed"
    params: dict[str, float | int | str | bool | list[str]] = Field(default_factory=dict, title="Parameters")
    source: Annotated[str | None, Field(title="Code")] = None
    entry_point: Annotated[str | None, Field(title="Function to call")] = None
    weight: Annotated[float, Field(title="Weight")] = 1.0

    @model_validator(mode="after")
    def _reward(self) -> RewardSpec:
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$", self.name):
            raise ValueError(f"name: {self.name!r} must be a Python identifier (letters, digits, underscores)")
        if self.kind == "builtin":
            if self.name not in BUILTIN_REWARDS:
                known = ", ".join(sorted(BUILTIN_REWARDS))
                raise ValueError(f"name: unknown built-in reward {self.name!r}; use one of {known}, or kind 'code'")
            unknown = set(self.params) - BUILTIN_REWARDS[self.name]
            if unknown:
                allowed = ", ".join(sorted(BUILTIN_REWARDS[self.name])) or "none"
                raise ValueError(f"params: {self.name} takes no parameter {sorted(unknown)}; allowed: {allowed}")
            if self.source is not None:
                raise ValueError("source: only for kind 'code'; remove it or set kind to 'code'")
        else:
            if not self.source or not self.source.strip():
                raise ValueError("source: kind 'code' needs Python code defining the reward function")
            if len(self.source.encode()) > MAX_REWARD_SOURCE_BYTES:
                raise ValueError(f"source: larger than {MAX_REWARD_SOURCE_BYTES // 1000} kB; keep rewards small")
            if not self.entry_point or not self.entry_point.isidentifier():
                raise ValueError("entry_point: kind 'code' needs the name of the reward function in source")
        if self.weight != self.weight or abs(self.weight) > 1e6:
            raise ValueError("weight: must be a finite number")
        return self


class LoraSpec(_Section):
    rank: Annotated[int, shown("LoRA rank", "training", "1 to 512")] = 1
    alpha: Annotated[float, shown("LoRA alpha", "training")] = 2.0
    target_modules: Annotated[
        str | list[str], shown("Target modules", "training", "all-linear, or names separated by commas")
    ] = "all-linear"
    dropout: Annotated[float, Field(ge=0.0, lt=1.0), shown("LoRA dropout", "training", advanced=True)] = 0.0

    @field_validator("rank")
    @classmethod
    def _rank(cls, value: int) -> int:
        """Any rank TRL trains and vLLM serves: the replicas' `--max-lora-rank` is rounded up to one vLLM accepts
        (`derived.vllm_max_lora_rank`, as TRL rounds), so an r=4 adapter is served under 8."""
        if not 1 <= value <= VLLM_LORA_RANKS[-1]:
            raise ValueError(f"{value} is out of range; use a rank from 1 to {VLLM_LORA_RANKS[-1]} (vLLM's largest)")
        return value

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, value: str | list[str]) -> str | list[str]:
        names = [value] if isinstance(value, str) else value
        if not names or any(not name.strip() for name in names):
            raise ValueError("name at least one module, or 'all-linear'")
        if any(name in ("lm_head", "embed_tokens") for name in names):
            raise ValueError("LoRA on lm_head or embed_tokens cannot be synced to vLLM; remove it")
        return value


class GrpoSpec(_Section):
    num_generations: Annotated[int, Field(ge=2, le=64), shown("Generations per prompt", "training")] = 8
    completions_per_step: Annotated[
        int, Field(ge=2), shown("Completions per step", "training", "a multiple of the generations per prompt")
    ] = 128
    max_completion_length: Annotated[int, Field(ge=1), shown("Max completion tokens", "training")] = 3000
    temperature: Annotated[float, Field(gt=0.0, le=10.0), shown("Temperature", "training", advanced=True)] = 1.0
    top_p: Annotated[
        float, Field(gt=0.0, le=1.0), shown("Top-p", "training", "1: TRL 1.16 does not model truncation", advanced=True)
    ] = 1.0
    top_k: Annotated[int, Field(ge=0), shown("Top-k", "training", "0 = off", advanced=True)] = 0
    learning_rate: Annotated[float, Field(gt=0.0, lt=1.0), shown("Learning rate", "training")] = 4e-5
    adam_beta2: Annotated[float, Field(gt=0.0, lt=1.0), shown("Adam β2", "training", advanced=True)] = 0.95
    epsilon: Annotated[float, Field(gt=0.0, lt=1.0), shown("Clip ε", "training", advanced=True)] = 0.2
    max_steps: Annotated[int, Field(ge=1), shown("Max steps", "training", "optimizer steps")] = 500
    max_staleness: Annotated[
        int, shown("Max staleness", "training", f"adapter versions a rollout may lag, 1 to {MAX_STALENESS}")
    ] = 4
    weight_sync_steps: Annotated[
        int, Field(ge=1), shown("Weight sync every", "training", "optimizer steps per adapter version", advanced=True)
    ] = 4
    max_inflight: Annotated[
        int | None,
        Field(ge=1),
        shown("Max in flight", "training", "requests at the replicas at once", unset=_AUTO_LIMIT, advanced=True),
    ] = None
    queue_size: Annotated[
        int | None,
        Field(ge=1),
        shown("Queue size", "training", "scored samples waiting for the trainer", unset=_AUTO_LIMIT, advanced=True),
    ] = None
    token_budget: Annotated[
        int, Field(ge=0), shown("Token budget", "training", "0 = off: completions per step", advanced=True)
    ] = 0
    gradient_checkpointing: Annotated[bool, shown("Gradient checkpointing", "training", advanced=True)] = True
    save_steps: Annotated[int, Field(ge=1), shown("Checkpoint every", "training", "optimizer steps", advanced=True)] = (
        50
    )
    seed: Annotated[int, Field(ge=0), shown("Seed", "training", advanced=True)] = 42
    audit_every: Annotated[
        int, Field(ge=0), shown("Policy audit every", "training", "versions; 0 = only the final one", advanced=True)
    ] = 10

    @field_validator("max_steps")
    @classmethod
    def _max_steps(cls, value: int) -> int:
        if value > MAX_STEPS:
            raise ValueError(f"{value} is more steps than any run takes; use at most {MAX_STEPS:,}")
        return value

    @field_validator("seed")
    @classmethod
    def _seed(cls, value: int) -> int:
        if value > MAX_SEED:
            raise ValueError(f"{value} is too large; use a seed from 0 to {MAX_SEED} (NumPy's range)")
        return value

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, value: float, info: ValidationInfo) -> float:
        if value < 1.0 and _new_input(info):
            raise ValueError(f"{value} truncates sampling, {_NO_TRUNCATION}; leave top-p at 1")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int, info: ValidationInfo) -> int:
        if value > 0 and _new_input(info):
            raise ValueError(f"{value} truncates sampling, {_NO_TRUNCATION}; leave top-k at 0 (off)")
        return value

    @field_validator("max_staleness")
    @classmethod
    def _staleness(cls, value: int, info: ValidationInfo) -> int:
        if value < 0:
            raise ValueError("cannot be negative; use 1 or more")
        if value == 0 and _new_input(info):
            raise ValueError(
                "0 cannot work with TRL 1.16: it unloads the previous adapter version before new requests move to "
                "the next, so requests still in flight fail; use 1 (nearly on-policy) or more"
            )
        if value > MAX_STALENESS:
            raise ValueError(
                f"{value} is too large: replicas must hold max_staleness + 2 adapters; use at most {MAX_STALENESS}"
            )
        return value

    # The group-shape checks are field validators reading the generations per prompt (validated before them), not a
    # model check: a model check runs only once every field is valid, so the form showed these errors only after the
    # others had been mended. Each is skipped while num_generations itself is invalid.
    @field_validator("completions_per_step")
    @classmethod
    def _whole_groups(cls, value: int, info: ValidationInfo) -> int:
        group = info.data.get("num_generations")
        if group and value % group:
            raise ValueError(
                f"{value} must be a multiple of num_generations ({group}) so every step trains whole groups"
            )
        return value

    @field_validator("max_inflight", "queue_size")
    @classmethod
    def _one_group(cls, value: int | None, info: ValidationInfo) -> int | None:
        group = info.data.get("num_generations")
        if value is not None and group and value < group:
            raise ValueError(
                f"{value} cannot hold one group of {group} generations; raise it to at least {group}, or leave it "
                "empty to derive it from the staleness window"
            )
        return value


class ComputeSpec(_Section):
    backend: Annotated[
        Literal["local", "hf_jobs"],
        shown(
            "Where the jobs run",
            "compute",
            choices={"local": "This machine (local processes)", "hf_jobs": "Hugging Face Jobs"},
        ),
    ] = "local"
    namespace: Annotated[str | None, shown("Namespace", "compute", "the user or organisation billed")] = None
    trainer_flavor: Annotated[str, shown("Trainer hardware", "compute")] = "h200x2"
    replica_flavor: Annotated[str, shown("Replica hardware", "compute")] = "h200"
    replicas: Annotated[int, shown("Replicas", "compute", f"inference replicas, 1 to {MAX_REPLICAS}")] = 2
    timeout: Annotated[str, shown("Timeout", "compute", "e.g. 90m, 4h")] = "4h"
    # How long a replica may wait for its flavor (SCHEDULING), and then take from its start to answering /health
    # (None: the backend's default, 15 min on HF Jobs). Bounded apart: a busy flavor is not a broken replica.
    queue_timeout: Annotated[str, shown("Queue limit", "compute", "how long a replica may wait for its hardware")] = (
        "30m"
    )
    startup_timeout: Annotated[
        str | None,
        shown(
            "Start-up limit",
            "compute",
            "from a replica's start to healthy; empty: 15m on HF Jobs, 5m here",
            advanced=True,
        ),
    ] = None
    replica_image: Annotated[str, shown("Replica image", "compute", advanced=True)] = "vllm/vllm-openai:v0.27.1"
    trainer_image: Annotated[str, shown("Trainer image", "compute", advanced=True)] = "vllm/vllm-openai:v0.27.1"
    engine: Annotated[  # auto: vLLM where CUDA is present, else the CPU engine
        Literal["auto", "vllm", "cpu"],
        shown(
            "Inference engine",
            "compute",
            advanced=True,
            choices={"auto": "auto", "vllm": "vLLM", "cpu": "CPU engine"},
        ),
    ] = "auto"
    cost_cap_usd: Annotated[
        float | None, Field(gt=0), shown("Cost cap", "compute", "US dollars", unset="none", advanced=True)
    ] = None
    # Data-parallel training processes. None: one per GPU of the trainer flavor on HF Jobs, one locally.
    trainer_processes: Annotated[
        int | None,
        Field(ge=1, le=8),
        shown("Trainer processes", "compute", "one per GPU", unset="auto", advanced=True),
    ] = None
    # How several trainer processes hold the model: "ddp" a whole float32 copy each, "fsdp" sharded over them (FSDP2),
    # "auto" FSDP exactly when a whole copy does not fit one GPU of the flavor (decided from the model's size).
    trainer_sharding: Annotated[
        Literal["auto", "ddp", "fsdp"],
        shown("Trainer sharding", "compute", "auto: FSDP when one model copy does not fit a GPU", advanced=True),
    ] = "auto"

    @field_validator("replicas")
    @classmethod
    def _replicas(cls, value: int) -> int:
        if not 1 <= value <= MAX_REPLICAS:
            raise ValueError(f"{value} is out of range; use 1 to {MAX_REPLICAS} replicas")
        return value

    @field_validator("timeout", "queue_timeout", "startup_timeout")
    @classmethod
    def _timeout(cls, value: str | None) -> str | None:
        if value is not None:
            timeout_seconds(value)
        return value

    @field_validator("trainer_flavor", "replica_flavor", "namespace")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^[A-Za-z0-9][\w.-]{0,95}$", value):
            raise ValueError(f"{value!r} is not a valid name (letters, digits, '-', '_', '.')")
        return value

    @model_validator(mode="after")
    def _hub(self, info: ValidationInfo) -> ComputeSpec:
        if self.backend != "hf_jobs" or not _new_input(info):
            return self
        if not self.namespace:
            raise ValueError("namespace: required for HF Jobs: your username or an organisation you can bill")
        for field in ("trainer_flavor", "replica_flavor"):
            if getattr(self, field) not in FLAVORS:
                raise ValueError(
                    f"{field}: {getattr(self, field)!r} is not an HF Jobs flavor; choose one of {', '.join(FLAVORS)}"
                )
        if timeout_seconds(self.timeout) < MIN_HUB_TIMEOUT_S:
            raise ValueError(
                f"timeout: {self.timeout!r} is too short for HF Jobs: scheduling, pulling the image and loading the "
                "model take minutes before training starts; use at least '10m' (e.g. '4h')"
            )
        gpus = FLAVORS[self.trainer_flavor].gpus
        if self.trainer_processes and gpus and self.trainer_processes > gpus:
            raise ValueError(
                f"trainer_processes: {self.trainer_flavor} has {gpus} GPU(s); use at most {gpus} (one process per "
                "GPU), or leave it empty"
            )
        return self

    @property
    def trainer_gpus(self) -> int:
        """GPUs the trainer job has: its flavor's on HF Jobs; none locally (the embedded default runs on the CPU)."""
        return flavor(self.trainer_flavor).gpus if self.backend == "hf_jobs" else 0

    @property
    def replica_gpus(self) -> int:
        """GPUs each replica job has: its flavor's on HF Jobs; none locally."""
        return flavor(self.replica_flavor).gpus if self.backend == "hf_jobs" else 0

    @property
    def training_ranks(self) -> int:
        """Training processes (data-parallel ranks): `trainer_processes`, else one per GPU of the trainer."""
        return self.trainer_processes or max(1, self.trainer_gpus)


class StorageSpec(_Section):
    uri: Annotated[str, shown("Bucket location", "storage")] = "file:///tmp/grpo-panel/store"
    endpoint: Annotated[str | None, shown("Endpoint", "storage")] = None
    region: Annotated[str | None, shown("Region", "storage")] = None

    @model_validator(mode="after")
    def _location(self) -> StorageSpec:
        try:
            parse_storage_uri(self.uri, endpoint=self.endpoint, region=self.region)
        except ValueError as error:
            field = "endpoint" if str(error).startswith("endpoint") else "uri"
            raise ValueError(f"{field}: {error}") from None
        return self


class ReportingSpec(_Section):
    """Where the trainer also reports its metrics (TRL's own names, through transformers' `report_to`): the panel
    always has them; Trackio and W&B are for users whose dashboards live there."""

    trackio: Annotated[bool, shown("Trackio", "reporting", "the public recipe's dashboard")] = False
    trackio_space: Annotated[
        str | None,
        shown("Trackio Space", "reporting", "owner/name of a Space for the dashboard; empty: a local Trackio project"),
    ] = None
    wandb: Annotated[bool, shown("Weights & Biases", "reporting", "with a W&B key saved on the Account page")] = False
    project: Annotated[
        str, shown("Project", "reporting", "the Trackio and W&B project; the run is named by its id")
    ] = "grpo-panel"
    wandb_entity: Annotated[
        str | None, shown("W&B entity", "reporting", "a team or user; empty: the key's default", advanced=True)
    ] = None

    @field_validator("project", "wandb_entity")
    @classmethod
    def _project(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^[A-Za-z0-9][\w.-]{0,127}$", value):
            raise ValueError(f"{value!r} is not a project name; use letters, digits, '-', '_' and '.'")
        return value

    @field_validator("trackio_space")
    @classmethod
    def _space(cls, value: str | None) -> str | None:
        value = (value or "").strip() or None
        if value is not None and ("/" not in value or ".." in value or not _HUB_ID.match(value)):
            raise ValueError(f"{value!r} is not a Space id; use 'owner/name' (created if it does not exist)")
        return value

    def report_to(self) -> list[str]:
        """transformers' `report_to` names, in a fixed order."""
        return [name for name, chosen in (("trackio", self.trackio), ("wandb", self.wandb)) if chosen]


MAX_EVAL_PROMPTS = 4096
MAX_EVAL_SAMPLES = 64


class EvalSpec(_Section):
    """Held-out prompts that adapter versions are scored on and never trained on (jobs/evaluation).

    They come from another split of the run's dataset, or from rows carved off the training split with `seed` (the
    trainer never sees those); either way, a prompt that also occurs in the training rows is dropped and counted.
    Off when neither is set. Every version is scored on the same prompts with the same seed per (prompt, sample), so
    two versions are compared on the same draws.
    """

    split: Annotated[
        str | None,
        shown(
            "Held-out split", "dataset", "another split of the dataset to evaluate versions on, e.g. test", unset="none"
        ),
    ] = None
    holdout: Annotated[
        int | None,
        Field(ge=1, le=MAX_EVAL_PROMPTS),
        shown(
            "Held-out rows",
            "dataset",
            "rows carved off the training split for evaluation; never trained on",
            unset="none",
        ),
    ] = None
    prompts: Annotated[
        int,
        Field(ge=1, le=MAX_EVAL_PROMPTS),
        shown("Eval prompts", "dataset", "held-out prompts each version is scored on", advanced=True),
    ] = 128
    k: Annotated[
        int,
        Field(ge=1, le=MAX_EVAL_SAMPLES),
        shown("Eval samples per prompt", "dataset", "k: completions drawn per held-out prompt", advanced=True),
    ] = 4
    greedy: Annotated[
        bool, shown("Greedy eval", "dataset", "one greedy completion per prompt (k = 1)", advanced=True)
    ] = False
    seed: Annotated[int, Field(ge=0, le=MAX_SEED), shown("Eval seed", "dataset", advanced=True)] = 0
    during_run: Annotated[
        bool,
        shown(
            "Evaluate during the run",
            "dataset",
            "the base model, every Nth version as it is published, and the last one",
            advanced=True,
        ),
    ] = True
    every: Annotated[
        int | None,
        Field(ge=1),
        shown(
            "Eval every N versions", "dataset", "during the run", unset="auto: ~10% of rollout tokens", advanced=True
        ),
    ] = None
    patience: Annotated[
        int,
        Field(ge=1, le=100),
        shown(
            "Eval patience",
            "dataset",
            "evaluations during the run without beating the best by more than its interval before an alert",
            advanced=True,
        ),
    ] = 3
    stop_on_regression: Annotated[
        bool,
        shown(
            "Stop when held-out stalls",
            "dataset",
            "after `patience` evaluations without improvement: stop the run and make the best version current",
            advanced=True,
        ),
    ] = False
    # Written like rewards (built-in or code, same sandbox) and scored on every held-out completion beside them, but
    # never trained on: e.g. exact-match accuracy next to a shaped reward. Reported as `metrics/<name>`, unweighted.
    metrics: Annotated[list[RewardSpec], Field(max_length=8, title="Eval metrics")] = Field(default_factory=list)

    @field_validator("split", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        return (value.strip() or None) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_source(self) -> EvalSpec:
        if self.split is not None and self.holdout is not None:
            raise ValueError("holdout: choose held-out rows or a held-out split, not both; empty one of them")
        if self.greedy and self.k > 1:
            raise ValueError(f"k: greedy decoding gives one completion per prompt, not {self.k}; set k to 1")
        names = [metric.name for metric in self.metrics]
        if len(set(names)) != len(names):
            raise ValueError("metrics: each metric needs a distinct name (it becomes the score metrics/<name>)")
        for index, metric in enumerate(self.metrics):
            if metric.weight != 1.0:
                raise ValueError(f"metrics.{index}.weight: a metric is reported as it is, never weighted; remove it")
        if self.metrics and not self.enabled:
            raise ValueError("metrics: they score held-out prompts; set a held-out split or held-out rows first")
        return self

    @property
    def enabled(self) -> bool:
        return self.split is not None or self.holdout is not None


class EnvironmentSpec(_Section):
    """Tools the model may call during an episode, for multi-turn GRPO (TRL's `tools` / `environment_factory`).

    They run where TRL's rollout child runs: on the trainer's CPU, beside the proxy. `none` keeps today's single-turn
    runs. Code defines module-level tool functions (typed, with a docstring TRL turns into the tool's schema) or
    environment classes (`reset(**row)`, their public methods the tools, an optional `get_reward()`), named by
    `entry_point`: the class, or the functions separated by commas. Several classes give each row its own environment,
    named by the dataset's `environment` column (TRL's environment per row); each row's prompt offers its tools only.
    `max_episode_tokens` caps the completion tokens of an episode over all its turns (TRL has no such cap). How many
    episodes run at once is `grpo.max_inflight`: each in-flight task is a whole episode, its tools included.
    """

    kind: Annotated[
        Literal["none", "builtin", "code"],
        shown(
            "Tools",
            "training",
            "tools the model may call over several turns",
            choices={"none": "none (single turn)", "builtin": "a built-in environment", "code": "my code"},
        ),
    ] = "none"
    name: Annotated[
        str, shown("Environment", "training", f"built-in: {', '.join(BUILTIN_ENVIRONMENTS)}", advanced=True)
    ] = "calculator"
    source: Annotated[str | None, Field(title="Environment code")] = None
    entry_point: Annotated[str | None, Field(title="Environment class or tools")] = None
    max_turns: Annotated[
        int,
        Field(ge=1, le=MAX_TURNS),
        shown("Max tool turns", "training", "tool-calling turns per episode (TRL's max_tool_calling_iterations)"),
    ] = 4
    max_episode_tokens: Annotated[
        int | None,
        Field(ge=2),
        shown(
            "Episode token budget",
            "training",
            "completion tokens an episode may generate over all its turns",
            unset="no budget: each turn up to the max completion length",
            advanced=True,
        ),
    ] = None
    packages: Annotated[
        list[str],
        Field(max_length=MAX_ENVIRONMENT_PACKAGES),
        shown(
            "Environment packages",
            "training",
            "what the environment's code imports beyond the job's packages: name==version, separated by commas",
            advanced=True,
        ),
    ] = Field(default_factory=list)

    @field_validator("packages")
    @classmethod
    def _packages(cls, value: list[str]) -> list[str]:
        for package in value:
            if not _PINNED_PACKAGE.match(package):
                raise ValueError(
                    f"{package!r} is not pinned; give each package as name==version (e.g. sympy==1.13.3), so every "
                    "run of this code gets the same one"
                )
        return value

    @model_validator(mode="after")
    def _environment(self) -> EnvironmentSpec:
        if self.kind == "builtin" and self.name not in BUILTIN_ENVIRONMENTS:
            known = ", ".join(BUILTIN_ENVIRONMENTS)
            raise ValueError(f"name: unknown built-in environment {self.name!r}; use one of {known}, or kind 'code'")
        if self.max_episode_tokens is not None and self.kind == "none":
            raise ValueError("max_episode_tokens: only for a run with tools; remove it, or pick tools")
        if self.packages and self.kind != "code":
            raise ValueError("packages: only for kind 'code' (the built-ins need none); remove them")
        if self.kind != "code":
            if self.source is not None or self.entry_point is not None:
                raise ValueError("source: only for kind 'code'; remove it and entry_point, or set kind to 'code'")
            return self
        if not self.source or not self.source.strip():
            raise ValueError("source: kind 'code' needs Python code defining the tools or the environment class")
        if len(self.source.encode()) > MAX_REWARD_SOURCE_BYTES:
            raise ValueError(f"source: larger than {MAX_REWARD_SOURCE_BYTES // 1000} kB; keep environments small")
        names = self.entry_points
        if not names or not all(name.isidentifier() for name in names):
            raise ValueError(
                "entry_point: name the environment class, or the tool functions separated by commas, defined in source"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    @property
    def entry_points(self) -> list[str]:
        return [name.strip() for name in (self.entry_point or "").split(",") if name.strip()]


class ParentSpec(_Section):
    run_id: Annotated[str, Field(title="Parent run id")]
    version: Annotated[int, Field(ge=1, title="Parent version")]


class RunSpec(_Section):
    schema_version: Annotated[Literal[1], Field(title="Spec version")] = SCHEMA_VERSION
    run_id: Annotated[str, shown("Run id", "run", "3-48 lowercase letters, digits and '-'")]
    name: Annotated[str, Field(max_length=120), shown("Name", "run")] = ""
    model: Annotated[ModelSpec, shown("Model", "model")] = Field(default_factory=ModelSpec)
    dataset: Annotated[DatasetSpec, shown("Dataset", "dataset")] = Field(default_factory=DatasetSpec)
    rewards: Annotated[list[RewardSpec], Field(min_length=1, max_length=8, title="Rewards")] = Field(
        default_factory=lambda: [RewardSpec()]
    )
    lora: Annotated[LoraSpec, shown("LoRA", "training")] = Field(default_factory=LoraSpec)
    grpo: Annotated[GrpoSpec, shown("Training", "training")] = Field(default_factory=GrpoSpec)
    compute: Annotated[ComputeSpec, shown("Compute", "compute")] = Field(default_factory=ComputeSpec)
    storage: Annotated[StorageSpec, shown("Bucket", "storage")] = Field(default_factory=StorageSpec)
    reporting: Annotated[ReportingSpec, shown("Reporting", "reporting")] = Field(default_factory=ReportingSpec)
    eval: Annotated[EvalSpec, shown("Evaluation", "dataset")] = Field(default_factory=EvalSpec)
    environment: Annotated[EnvironmentSpec, shown("Tools", "training")] = Field(default_factory=EnvironmentSpec)
    parent: Annotated[ParentSpec | None, Field(title="Parent run")] = None

    @model_validator(mode="before")
    @classmethod
    def _no_secrets(cls, data: Any) -> Any:
        for path, text in _strings(data):
            kind = find_secret(text)
            if kind:
                raise ValueError(
                    f"{path}: holds what looks like {kind}; secrets never go in a run spec: enter them in the "
                    "credentials form (they travel as Job secrets)"
                )
        return data

    @field_validator("run_id", mode="before")
    @classmethod
    def _run_id(cls, value: Any) -> Any:
        if not isinstance(value, str) or not RUN_ID_PATTERN.match(value):
            raise ValueError(
                f"{value!r} is not a valid run id; use 3-48 lowercase letters, digits and '-', "
                "starting and ending with a letter or digit (e.g. 'math-r1-0412')"
            )
        return value

    @model_validator(mode="after")
    def _cross_checks(self) -> RunSpec:
        names = [reward.name for reward in self.rewards]
        if len(set(names)) != len(names):
            raise ValueError("rewards: each reward needs a distinct name (it becomes the metric rewards/<name>)")
        for index, metric in enumerate(self.eval.metrics):
            if metric.name in names:
                raise ValueError(
                    f"eval.metrics.{index}.name: {metric.name!r} is already a reward of the run, and every reward's "
                    "held-out score is reported; remove the metric, or give it another name"
                )
        if self.grpo.max_completion_length >= self.model.max_model_len:
            raise ValueError(
                f"grpo.max_completion_length: {self.grpo.max_completion_length} must be below model.max_model_len "
                f"({self.model.max_model_len}) to leave room for the prompt"
            )
        if self.eval.split is not None:
            if self.eval.split == self.dataset.split:
                raise ValueError(
                    f"eval.split: {self.eval.split!r} is the split the run trains on; name another split (e.g. test), "
                    "or carve held-out rows off it instead"
                )
            if self.dataset.source == "store":
                raise ValueError(
                    "eval.split: a file in the bucket has no other split; carve held-out rows off it instead"
                )
        if self.parent is not None and self.parent.run_id == self.run_id:
            raise ValueError("parent.run_id: must name another run; a branch gets its own run id")
        processes = self.compute.training_ranks
        if self.grpo.completions_per_step % processes:
            raise ValueError(
                f"grpo.completions_per_step: {self.grpo.completions_per_step} must be a multiple of the "
                f"{processes} training processes, so every process trains the same number of completions"
            )
        if self.reporting.trackio and not self.reporting.trackio_space and self.compute.backend == "hf_jobs":
            raise ValueError(
                "reporting.trackio_space: a Trackio project written inside an HF Job is lost when the job ends; name "
                "a Space (owner/name) to hold the dashboard, or untick Trackio"
            )
        if self.compute.trainer_sharding == "fsdp" and processes == 1:
            raise ValueError(
                "compute.trainer_sharding: fsdp shards the model over several trainer processes and this run has one; "
                "set compute.trainer_processes to 2 or more (a flavor with several GPUs), or choose auto or ddp"
            )
        return self

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    @classmethod
    def from_json(cls, text: str | bytes) -> RunSpec:
        """A stored spec (see `parse_spec`)."""
        return parse_spec(json.loads(text), stored=True)


def parse_spec(data: dict[str, Any], stored: bool = False) -> RunSpec:
    """Validate `data` into a RunSpec, raising `SpecError` with one message per offending field.

    `stored`: a spec a run was created with, perhaps by an earlier version; the refusals added since then (marked
    `_new_input`) are not applied to it, so such a run still loads, polls and relaunches as it did.
    """
    try:
        return RunSpec.model_validate(data, context={"stored": stored})
    except ValidationError as error:
        raise SpecError(_field_errors(error)) from None


def _new_input(info: ValidationInfo) -> bool:
    """Whether a refusal added after specs were first stored applies: to new input, not to a stored spec."""
    return not (info.context or {}).get("stored")


def _strings(data: Any, path: str = "") -> list[tuple[str, str]]:
    """Every string in a JSON-like value, with the dotted path to it."""
    if isinstance(data, str):
        return [(path or "spec", data)]
    if isinstance(data, dict):
        return [item for key, value in data.items() for item in _strings(value, f"{path}.{key}".lstrip("."))]
    if isinstance(data, list):
        return [item for index, value in enumerate(data) for item in _strings(value, f"{path}[{index}]")]
    if isinstance(data, BaseModel):
        return _strings(data.model_dump(), path)
    return []


def _field_errors(error: ValidationError) -> dict[str, str]:
    errors: dict[str, str] = {}
    for item in error.errors():
        location = ".".join(str(part) for part in item["loc"] if not str(part).startswith("function-"))
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "is not a known field; check its spelling or remove it"
        elif item["type"] == "missing":
            message = "is required"
        # Model-level checks start their message with the field they concern ("queue_size: ..."): attach it there.
        named = _NAMED_FIELD.match(message)
        if named and item["type"] == "value_error":
            location = f"{location}.{named.group(1)}".lstrip(".")
            message = named.group(2)
        errors.setdefault(location or "spec", message)
    return errors
