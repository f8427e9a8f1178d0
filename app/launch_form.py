"""The launch form without the widgets: form values to a RunSpec dict and back, and errors to the field they concern.

The page hands every input as a flat {key: value} dict; keeping the translation here (pure functions) keeps the page
module about layout and wiring, and lets a spec from a preset or a parent run fill the same form.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

from jobs.contract import BUILTIN_REWARDS

BUCKET_KINDS = {
    "hf": "Hugging Face bucket",
    "aws": "AWS S3",
    "r2": "Cloudflare R2",
    "minio": "MinIO / other S3",
    "local": "Local folder",
}
BUCKET_HINTS = {
    "hf": ("hf://buckets/<namespace>/<bucket>/<prefix>", "https://s3.hf.co/<namespace> (automatic)", "automatic"),
    "aws": ("s3://<bucket>/<optional prefix>", "leave empty for AWS", "e.g. us-east-1"),
    "r2": ("s3://<bucket>/<optional prefix>", "https://<ACCOUNT_ID>.r2.cloudflarestorage.com", "auto"),
    "minio": ("s3://<bucket>/<optional prefix>", "http://host:9000", "us-east-1"),
    "local": ("file:///absolute/folder", "not used", "not used"),
}
BUILTIN_DESCRIPTIONS = {
    "math_boxed": "1 when the last \\boxed{} equals the answer column",
    "format": "fraction of the required tags present, in order",
    "length": "closeness of the length to a target (tokens)",
    "regex": "1 when the completion matches a pattern",
    "digit_frac": "fraction of digit tokens (the demo's reward)",
}
CODE_TEMPLATE = '''def reward(completions, answer, **columns):
    """Called once per group of completions; returns one score per completion.

    `completions` holds chat messages (or plain text in the sandbox); `answer` and every other
    dataset column arrive as lists of the same length.
    """
    scores = []
    for completion, gold in zip(completions, answer):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        scores.append(1.0 if str(gold).strip() and str(gold).strip() in text else 0.0)
    return scores
'''
# The form's inputs, in the order the page passes them to every handler.
KEYS = (
    "run_id", "name",
    "model_id", "model_revision", "max_model_len", "dtype",
    "dataset_source", "dataset_id", "dataset_split", "prompt_column", "answer_column", "system_prompt", "dataset_limit",
    "builtin_rewards", "format_tags", "length_target", "regex_pattern",
    "code_enabled", "code_name", "code_entry", "code_weight", "code_source",
    "bucket_kind", "storage_uri", "storage_endpoint", "storage_region", "store_credential",
    "backend", "namespace", "hf_credential", "trainer_flavor", "replica_flavor", "replicas", "timeout",
    "queue_timeout", "startup_timeout", "engine", "cost_cap",
    "lora_rank", "lora_alpha", "lora_targets", "lora_dropout",
    "num_generations", "completions_per_step", "max_completion_length", "learning_rate", "max_steps", "max_staleness",
    "temperature", "top_p", "top_k", "weight_sync_steps", "max_inflight", "queue_size", "token_budget",
    "gradient_checkpointing", "save_steps", "seed", "adam_beta2", "epsilon", "audit_every",
    "trainer_image", "replica_image",
)  # fmt: skip
# Where each input's errors are shown (a slot is a red note right under that group of fields).
SLOTS = (
    "run", "model", "dataset", "rewards_builtin", "rewards_code", "storage", "compute", "training", "advanced",
    "general",
)  # fmt: skip
# Dotted spec fields that live in the folded "Advanced" section; their errors open it.
ADVANCED = {
    "model.revision", "model.max_model_len", "model.dtype", "lora.dropout", "grpo.temperature", "grpo.top_p",
    "grpo.top_k", "grpo.weight_sync_steps", "grpo.max_inflight", "grpo.queue_size", "grpo.token_budget",
    "grpo.gradient_checkpointing", "grpo.save_steps", "grpo.seed", "grpo.adam_beta2", "grpo.epsilon",
    "grpo.audit_every", "compute.trainer_image", "compute.replica_image", "compute.engine", "compute.cost_cap_usd",
    "compute.trainer_processes", "compute.trainer_sharding", "compute.startup_timeout",
}  # fmt: skip
# The human label of every field an error can name (tests/test_form_errors.py checks that each RunSpec field has one).
LABELS = {
    "spec": "Settings", "schema_version": "Spec version", "run_id": "Run id", "name": "Name",
    "model": "Model", "model.id": "Model", "model.revision": "Revision", "model.max_model_len": "Max model length",
    "model.dtype": "Dtype",
    "dataset": "Dataset", "dataset.id": "Dataset", "dataset.source": "Dataset source", "dataset.split": "Split",
    "dataset.prompt_column": "Prompt column", "dataset.answer_column": "Answer column", "dataset.limit": "Row limit",
    "dataset.system_prompt": "System prompt",
    "rewards": "Rewards",
    "storage": "Bucket", "storage.uri": "Bucket location", "storage.endpoint": "Endpoint", "storage.region": "Region",
    "storage.credentials": "Bucket keys",
    "compute": "Compute", "compute.token": "HF token", "compute.backend": "Where the jobs run",
    "compute.namespace": "Namespace", "compute.trainer_flavor": "Trainer hardware",
    "compute.replica_flavor": "Replica hardware", "compute.replicas": "Replicas", "compute.timeout": "Timeout",
    "compute.queue_timeout": "Queue limit", "compute.startup_timeout": "Start-up limit",
    "compute.engine": "Inference engine", "compute.cost_cap_usd": "Cost cap",
    "compute.trainer_processes": "Trainer processes", "compute.trainer_sharding": "Trainer sharding",
    "compute.trainer_image": "Trainer image",
    "compute.replica_image": "Replica image",
    "lora": "LoRA", "lora.rank": "LoRA rank", "lora.alpha": "LoRA alpha", "lora.target_modules": "Target modules",
    "lora.dropout": "LoRA dropout",
    "grpo": "Training", "grpo.num_generations": "Generations per prompt",
    "grpo.completions_per_step": "Completions per step", "grpo.max_completion_length": "Max completion tokens",
    "grpo.learning_rate": "Learning rate", "grpo.max_steps": "Max steps", "grpo.max_staleness": "Max staleness",
    "grpo.temperature": "Temperature", "grpo.top_p": "Top-p", "grpo.top_k": "Top-k",
    "grpo.weight_sync_steps": "Weight sync every", "grpo.max_inflight": "Max in flight",
    "grpo.queue_size": "Queue size",
    "grpo.token_budget": "Token budget", "grpo.gradient_checkpointing": "Gradient checkpointing",
    "grpo.save_steps": "Checkpoint every", "grpo.seed": "Seed", "grpo.adam_beta2": "Adam β2", "grpo.epsilon": "Clip ε",
    "grpo.audit_every": "Policy audit every",
    "parent": "Parent run", "parent.run_id": "Parent run id", "parent.version": "Parent version",
}  # fmt: skip
# A reward's own fields (`rewards.<i>.<field>`), as the form names them.
REWARD_LABELS = {
    "kind": "Kind", "name": "Name", "params": "Parameters", "source": "Code", "entry_point": "Function to call",
    "weight": "Weight",
}  # fmt: skip
# Which note shows the errors of each section (a field of "Advanced" goes to that note instead: ADVANCED above).
SECTION_SLOTS = {
    "run_id": "run", "name": "run", "model": "model", "dataset": "dataset", "storage": "storage", "compute": "compute",
    "lora": "training", "grpo": "training",
}  # fmt: skip
_SECTIONS = {key.split(".", 1)[0] for key in LABELS if "." in key}
_REWARD = re.compile(r"^rewards\.(\d+)(?:\.(.+))?$")


@dataclass
class Built:
    """A spec dict from the form, and for each entry of `rewards` the slot that shows its errors."""

    spec: dict[str, Any]
    reward_slots: list[str] = field(default_factory=list)


def new_run_id(prefix: str) -> str:
    return f"{prefix}-{time.strftime('%m%d-%H%M%S')}".lower()


def _text(value: Any) -> str | None:
    text = str(value).strip() if value is not None else ""
    return text or None


def _int(value: Any) -> int | None:
    if value is None or value == "":
        return None
    return int(value)


def _positive(value: Any) -> int | None:
    """0 or empty means 'not set' for the optional counts (row limit, queue size)."""
    number = _int(value)
    return number if number else None


def _targets(value: Any) -> str | list[str]:
    text = (_text(value) or "all-linear").replace(";", ",")
    if text == "all-linear":
        return text
    return [name.strip() for name in re.split(r"[,\s]+", text) if name.strip()]


def _credential(value: Any) -> int | None:
    return int(value) if value not in (None, "", "none") else None


def credentials(form: dict[str, Any]) -> tuple[int | None, int | None]:
    """The (bucket keys, HF token) credential ids the form selects."""
    return _credential(form.get("store_credential")), _credential(form.get("hf_credential"))


def rewards_of(form: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    rewards, slots = [], []
    for name in form.get("builtin_rewards") or []:
        params: dict[str, Any] = {}
        if name == "format" and _text(form.get("format_tags")):
            params["tags"] = [t for t in re.split(r"[,\s]+", form["format_tags"]) if t]
        if name == "length" and form.get("length_target"):
            params["target"] = int(form["length_target"])
        if name == "regex":
            params["pattern"] = form.get("regex_pattern") or ""
        rewards.append({"kind": "builtin", "name": name, "params": params})
        slots.append("rewards_builtin")
    if form.get("code_enabled"):
        rewards.append(
            {
                "kind": "code",
                "name": _text(form.get("code_name")) or "custom",
                "source": form.get("code_source") or "",
                "entry_point": _text(form.get("code_entry")) or "",
                "weight": float(form.get("code_weight") or 1.0),
            }
        )
        slots.append("rewards_code")
    return rewards, slots


def spec_from_form(form: dict[str, Any]) -> Built:
    """The RunSpec dict the form describes (validation is the backend's: this only shapes the values)."""
    rewards, slots = rewards_of(form)
    hf_jobs = form.get("backend") == "hf_jobs"
    spec = {
        "run_id": (form.get("run_id") or "").strip(),
        "name": (form.get("name") or "").strip(),
        "model": {
            "id": (form.get("model_id") or "").strip(),
            "revision": _text(form.get("model_revision")),
            "max_model_len": _int(form.get("max_model_len")),
            "dtype": form.get("dtype"),
        },
        "dataset": {
            "source": form.get("dataset_source"),
            "id": (form.get("dataset_id") or "").strip(),
            "split": (form.get("dataset_split") or "").strip(),
            "prompt_column": (form.get("prompt_column") or "").strip(),
            "answer_column": _text(form.get("answer_column")),
            "system_prompt": _text(form.get("system_prompt")),
            "limit": _positive(form.get("dataset_limit")),
        },
        "rewards": rewards,
        "lora": {
            "rank": _int(form.get("lora_rank")),
            "alpha": form.get("lora_alpha"),
            "target_modules": _targets(form.get("lora_targets")),
            "dropout": form.get("lora_dropout") or 0.0,
        },
        "grpo": {
            key: form.get(key)
            for key in (
                "num_generations",
                "completions_per_step",
                "max_completion_length",
                "learning_rate",
                "max_steps",
                "max_staleness",
                "temperature",
                "top_p",
                "top_k",
                "weight_sync_steps",
                "max_inflight",
                "token_budget",
                "gradient_checkpointing",
                "save_steps",
                "seed",
                "adam_beta2",
                "epsilon",
                "audit_every",
            )
        }
        | {"queue_size": _positive(form.get("queue_size"))},
        "compute": {
            "backend": form.get("backend"),
            "namespace": _text(form.get("namespace")) if hf_jobs else None,
            "trainer_flavor": _text(form.get("trainer_flavor")) or "cpu-basic",
            "replica_flavor": _text(form.get("replica_flavor")) or "cpu-basic",
            "replicas": _int(form.get("replicas")),
            "timeout": (form.get("timeout") or "").strip(),
            "queue_timeout": (form.get("queue_timeout") or "").strip() or None,
            "startup_timeout": _text(form.get("startup_timeout")),
            "engine": form.get("engine"),
            "cost_cap_usd": form.get("cost_cap") or None,
            "trainer_image": (form.get("trainer_image") or "").strip(),
            "replica_image": (form.get("replica_image") or "").strip(),
        },
        "storage": {
            "uri": (form.get("storage_uri") or "").strip(),
            "endpoint": _text(form.get("storage_endpoint")) if form.get("bucket_kind") in ("r2", "minio") else None,
            "region": _text(form.get("storage_region")) if form.get("bucket_kind") in ("aws", "r2", "minio") else None,
        },
    }
    for section in ("model", "grpo", "compute", "lora", "dataset"):
        spec[section] = {k: v for k, v in spec[section].items() if v is not None or k in _NULLABLE}
    return Built(spec, slots)


_NULLABLE = {
    "revision", "answer_column", "system_prompt", "limit", "queue_size", "namespace", "cost_cap_usd", "startup_timeout",
}  # fmt: skip


def form_from_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Form values for a spec dict (a preset, or a parent run's spec): the inverse of `spec_from_form`."""
    model, dataset, lora = spec.get("model", {}), spec.get("dataset", {}), spec.get("lora", {})
    grpo, compute, storage = spec.get("grpo", {}), spec.get("compute", {}), spec.get("storage", {})
    builtins = [r for r in spec.get("rewards", []) if r.get("kind", "builtin") == "builtin"]
    code = next((r for r in spec.get("rewards", []) if r.get("kind") == "code"), None)
    params = {r["name"]: r.get("params") or {} for r in builtins}
    targets = lora.get("target_modules", "all-linear")
    uri = storage.get("uri", "")
    form = {
        "run_id": spec.get("run_id", ""),
        "name": spec.get("name", ""),
        "model_id": model.get("id", ""),
        "model_revision": model.get("revision") or "",
        "max_model_len": model.get("max_model_len", 4096),
        "dtype": model.get("dtype", "bfloat16"),
        "dataset_source": dataset.get("source", "hub"),
        "dataset_id": dataset.get("id", ""),
        "dataset_split": dataset.get("split", "train"),
        "prompt_column": dataset.get("prompt_column", "prompt"),
        "answer_column": dataset.get("answer_column") or "",
        "system_prompt": dataset.get("system_prompt") or "",
        "dataset_limit": dataset.get("limit") or 0,
        "builtin_rewards": [r["name"] for r in builtins],
        "format_tags": " ".join(params.get("format", {}).get("tags", ["<think>", "</think>", "<answer>", "</answer>"])),
        "length_target": params.get("length", {}).get("target", 256),
        "regex_pattern": params.get("regex", {}).get("pattern", ""),
        "code_enabled": code is not None,
        "code_name": (code or {}).get("name", "custom"),
        "code_entry": (code or {}).get("entry_point", "reward"),
        "code_weight": (code or {}).get("weight", 1.0),
        "code_source": (code or {}).get("source") or CODE_TEMPLATE,
        "bucket_kind": bucket_kind(uri, storage.get("endpoint")),
        "storage_uri": uri,
        "storage_endpoint": storage.get("endpoint") or "",
        "storage_region": storage.get("region") or "",
        "backend": compute.get("backend", "local"),
        "namespace": compute.get("namespace") or "",
        "trainer_flavor": compute.get("trainer_flavor", "h200x2"),
        "replica_flavor": compute.get("replica_flavor", "h200"),
        "replicas": compute.get("replicas", 2),
        "timeout": compute.get("timeout", "4h"),
        "queue_timeout": compute.get("queue_timeout", "30m"),
        "startup_timeout": compute.get("startup_timeout") or "",
        "engine": compute.get("engine", "auto"),
        "cost_cap": compute.get("cost_cap_usd") or 0,
        "trainer_image": compute.get("trainer_image", "vllm/vllm-openai:v0.27.1"),
        "replica_image": compute.get("replica_image", "vllm/vllm-openai:v0.27.1"),
        "lora_rank": lora.get("rank", 1),
        "lora_alpha": lora.get("alpha", 2.0),
        "lora_targets": targets if isinstance(targets, str) else ", ".join(targets),
        "lora_dropout": lora.get("dropout", 0.0),
        "queue_size": grpo.get("queue_size") or 0,
    }
    defaults = {
        "num_generations": 8, "completions_per_step": 128, "max_completion_length": 3000, "learning_rate": 4e-5,
        "max_steps": 500, "max_staleness": 4, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "weight_sync_steps": 4,
        "max_inflight": 128, "token_budget": 0, "gradient_checkpointing": True, "save_steps": 50, "seed": 42,
        "adam_beta2": 0.95, "epsilon": 0.2, "audit_every": 10,
    }  # fmt: skip
    form.update({key: grpo.get(key, default) for key, default in defaults.items()})
    return form


def bucket_kind(uri: str, endpoint: str | None) -> str:
    if uri.startswith("file://"):
        return "local"
    if uri.startswith("hf://"):
        return "hf"
    if endpoint and "r2.cloudflarestorage.com" in endpoint:
        return "r2"
    return "minio" if endpoint else "aws"


def field_path(key: str) -> str:
    """An error key as a dotted path. Validation names list items `rewards.1.source`; the secret check names them as
    JSON paths, `rewards[1].source`: both become `rewards.1.source`."""
    return re.sub(r"\[(\d+)\]", r".\1", key.strip())


def _field_label(path: str) -> str | None:
    """The label of `path`, or of the field it lies in (`lora.target_modules.0`, a union member such as
    `lora.target_modules.list[str]`): the longest labelled prefix that names a field, not only a section."""
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in LABELS and (end == len(parts) or prefix not in _SECTIONS):
            return LABELS[prefix]
    return None


def label(dotted: str, rewards: list[dict[str, Any]] | None = None) -> str:
    """The human label of an error key (a spec field, or one of preflight's own), never the raw key."""
    path = field_path(dotted)
    match = _REWARD.match(path)
    if match:
        index, rest = int(match.group(1)), match.group(2)
        name = (rewards[index].get("name") if rewards and index < len(rewards) else None) or ""
        reward = f"reward {index + 1}" + (f" ({name})" if name else "")
        if rest is None:
            return reward[0].upper() + reward[1:]
        field_name = rest.split(".", 1)[0]
        return f"{REWARD_LABELS.get(field_name, _words(field_name).capitalize())} of {reward}"
    known = _field_label(path)
    if known is not None:
        return known
    head, _, rest = path.partition(".")
    section = LABELS.get(head, "Settings")
    return f"{section}: {_words(rest)}" if rest else f"{section}: {_words(head)}"


def _words(name: str) -> str:
    """A field name nobody gave a label (a misspelt one, say) as words: `max_stalenes` -> `max stalenes`."""
    return re.sub(r"[_.\[\]]+", " ", name).strip()


def _in(path: str, fields: set[str]) -> bool:
    """Whether `path` is one of `fields` or lies inside one of them."""
    return any(path == name or path.startswith(name + ".") for name in fields)


def slot_of(dotted: str, reward_slots: list[str], code_enabled: bool) -> str:
    """Which note under the form shows an error about `dotted` (a field name from Preflight.errors)."""
    path = field_path(dotted)
    if _in(path, ADVANCED):
        return "advanced"
    match = _REWARD.match(path)
    if match and int(match.group(1)) < len(reward_slots):
        return reward_slots[int(match.group(1))]
    head = path.split(".", 1)[0]
    if head == "rewards":
        return "rewards_code" if code_enabled else "rewards_builtin"
    return SECTION_SLOTS.get(head, "general")


def route_errors(errors: dict[str, str], built: Built | None, code_enabled: bool) -> dict[str, list[str]]:
    """{slot: ["Label: message", ...]} for every slot (empty lists included, so stale notes are cleared)."""
    routed: dict[str, list[str]] = {slot: [] for slot in SLOTS}
    slots = built.reward_slots if built else []
    rewards = built.spec.get("rewards") if built else None
    for dotted, message in errors.items():
        # A reward's own errors already start with its name ("custom (row 2): ..."): no label in front.
        whole_reward = re.fullmatch(r"rewards\.\d+", field_path(dotted))
        text = message if whole_reward else f"{label(dotted, rewards)}: {message}"
        routed[slot_of(dotted, slots, code_enabled)].append(text)
    return routed


def builtin_choices() -> list[tuple[str, str]]:
    return [(f"{name} — {BUILTIN_DESCRIPTIONS.get(name, '')}", name) for name in BUILTIN_REWARDS]
