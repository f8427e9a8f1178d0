"""The launch form without the widgets, generated from RunSpec: which fields it has, their labels, help, defaults
and sections, form values to a RunSpec dict and back, and errors to the note of the field they concern.

Every spec field declared with `shown(...)` (jobs/contract/spec.py) is a field of the form: adding one there puts it
on the Launch page (app/pages/launch.py lays out what it does not place by hand), in the spec the form builds, in
`form_from_spec` and in the error notes, with no other edit. The rewards (a list) and the credentials are the form's
own inputs and are shaped here by hand.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel

from backend.credentials.vault import RunCredentials
from jobs.contract import BUILTIN_REWARDS, RunSpec

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
# The form's own inputs, beside the spec's fields: the rewards, the bucket's kind and the credentials chosen.
OWN_KEYS = (
    "builtin_rewards", "format_tags", "length_target", "regex_pattern",
    "code_enabled", "code_name", "code_entry", "code_weight", "code_source", "builtin_metrics", "code_metrics",
    "bucket_kind", "store_credential", "hf_credential", "wandb_credential",
)  # fmt: skip
# Where errors are shown: a note right under each part of the form (a spec field's `section` names its part).
SLOTS = (
    "run", "model", "dataset", "rewards_builtin", "rewards_code", "storage", "compute", "training", "reporting",
    "advanced", "general",
)  # fmt: skip
# Error keys preflight names that are no spec field.
OWN_LABELS = {
    "spec": "Settings",
    "compute.token": "HF token",
    "storage.credentials": "Bucket keys",
    "reporting.wandb_key": "W&B key",
}
# The lists of functions the form edits as built-ins and code: the run's rewards, and its eval metrics (scored on the
# held-out prompts beside the rewards, never trained on). An error names one as `<list>.<index>[.<field>]`.
_FUNCTION = re.compile(r"^(rewards|eval\.metrics)\.(\d+)(?:\.(.+))?$")
_FUNCTION_WORD = {"rewards": "reward", "eval.metrics": "eval metric"}
FieldKind = Literal["int", "float", "bool", "choice", "text", "other"]


@dataclass(frozen=True)
class FormField:
    """One spec field as the form shows it (from its `shown(...)` metadata and its type)."""

    path: str  # dotted, as in error keys: "grpo.max_steps"; also the field's key in the form's values
    label: str
    help: str
    section: str  # the part of the form, and the note its errors go to
    advanced: bool
    unset: str  # what an empty optional value means ("auto"); "" when the field has no such meaning
    kind: FieldKind
    options: tuple[Any, ...]  # a literal's values
    words: dict[str, str]  # a literal's values in words
    optional: bool
    default: Any
    limits: str = ""  # the spec's bounds in words: "2 to 64", "above 0, below 1"

    @property
    def elem_id(self) -> str:
        return self.path.replace(".", "-").replace("_", "-")

    @property
    def info(self) -> str:
        """The help under the widget: what the field means, and what 0 or empty stands for."""
        blank = "0" if self.kind in ("int", "float") else "empty"
        unset = f"{blank} = {self.unset}" if self.unset else ""
        return "; ".join(part for part in (self.help, self.limits, unset) if part)

    def choices(self) -> list[tuple[str, Any]]:
        return [(self.words.get(str(option), str(option)), option) for option in self.options]

    def to_spec(self, value: Any) -> Any:
        """The spec value of a form value; `_OMIT` for an empty box of a field that has a default."""
        if self.kind == "bool":
            return bool(value)
        if self.kind == "text":
            text = str(value).strip() if value is not None else ""
            return None if not text and self.optional else text
        if value is None or value == "":
            return None if self.optional else _OMIT
        if self.kind in ("int", "float") and self.optional and self.unset and value == 0:
            return None
        return value

    def to_form(self, value: Any) -> Any:
        if value is None:
            return 0 if self.kind in ("int", "float") else ""
        return value


_OMIT = object()


def _kind(annotation: Any) -> tuple[FieldKind, tuple[Any, ...], bool]:
    """(kind, a literal's values, whether None is allowed) of a field's type."""
    args = typing.get_args(annotation)
    optional = typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args
    if optional:
        rest = [arg for arg in args if arg is not type(None)]
        if len(rest) != 1:
            return "other", (), True
        annotation = rest[0]
    if typing.get_origin(annotation) is Literal:
        return "choice", typing.get_args(annotation), optional
    kinds: dict[Any, FieldKind] = {bool: "bool", int: "int", float: "float", str: "text"}
    return kinds.get(annotation, "other"), (), optional


def _limits(metadata: list[Any]) -> str:
    """A field's numeric bounds (pydantic's ge/gt/le/lt) in words: "2 to 64", "above 0, below 1"."""
    ge = gt = le = lt = None
    for bound in metadata:
        ge = getattr(bound, "ge", ge) if isinstance(bound, annotated_types.Ge) else ge
        gt = getattr(bound, "gt", gt) if isinstance(bound, annotated_types.Gt) else gt
        le = getattr(bound, "le", le) if isinstance(bound, annotated_types.Le) else le
        lt = getattr(bound, "lt", lt) if isinstance(bound, annotated_types.Lt) else lt
    if ge is not None and le is not None:
        return f"{_number(ge)} to {_number(le)}"
    low = f"from {_number(ge)}" if ge is not None else f"above {_number(gt)}" if gt is not None else ""
    high = f"up to {_number(le)}" if le is not None else f"below {_number(lt)}" if lt is not None else ""
    if low and high:
        return f"{low}, {high}"
    return f"{_number(ge)} or more" if ge is not None else low or high


def _number(value: Any) -> str:
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The model a section field holds (directly or optionally), or the item model of a list of them."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        model = _section_model(arg)
        if model is not None:
            return model
    return None


def _hints(info: Any) -> dict[str, Any] | None:
    extra = info.json_schema_extra
    return extra.get("form") if isinstance(extra, dict) else None


class FormSchema:
    """The launch form of a spec model: its fields, their labels and the notes their errors go to."""

    def __init__(self, model: type[BaseModel] = RunSpec):
        self.model = model
        self.fields: list[FormField] = []
        self.labels: dict[str, str] = dict(OWN_LABELS)
        self.section_slots: dict[str, str] = {}  # a top-level field -> the note of its part of the form
        self.item_labels: dict[str, dict[str, str]] = {}  # a list of sections ("rewards") -> its items' labels
        for name, info in model.model_fields.items():
            hints = _hints(info)
            if info.title:
                self.labels[name] = info.title
            if hints:
                self.section_slots[name] = hints["section"]
            inner = _section_model(info.annotation)
            if inner is None:
                if hints:
                    self.fields.append(_field(name, info, hints, hints["section"]))
                continue
            labels = {sub: sub_info.title for sub, sub_info in inner.model_fields.items() if sub_info.title}
            if typing.get_origin(info.annotation) is list:
                self.item_labels[name] = labels
                continue
            self.labels.update({f"{name}.{sub}": label for sub, label in labels.items()})
            for sub, sub_info in inner.model_fields.items():
                sub_hints = _hints(sub_info)
                if sub_hints:
                    self.fields.append(_field(f"{name}.{sub}", sub_info, sub_hints, sub_hints["section"]))
        self.by_path = {form_field.path: form_field for form_field in self.fields}
        self.keys: tuple[str, ...] = (*OWN_KEYS, *self.by_path)
        self.advanced = {form_field.path for form_field in self.fields if form_field.advanced}
        self._sections = {path.split(".", 1)[0] for path in self.labels if "." in path}

    # -- values ----------------------------------------------------------------------------------------------------

    def spec_from_form(self, form: dict[str, Any]) -> Built:
        """The RunSpec dict the form describes (validation is the backend's: this only shapes the values)."""
        spec: dict[str, Any] = {}
        for form_field in self.fields:
            convert = _TO_SPEC.get(form_field.path)
            value = (
                convert(form.get(form_field.path), form) if convert else form_field.to_spec(form.get(form_field.path))
            )
            if value is _OMIT:
                continue
            *parents, last = form_field.path.split(".")
            node = spec
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = value
        rewards, slots = rewards_of(form)
        spec["rewards"] = rewards
        metrics, metric_slots = metrics_of(form)
        if metrics:
            spec.setdefault("eval", {})["metrics"] = metrics
        return Built(spec, slots, metric_slots)

    def form_from_spec(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Form values for a spec dict (a preset, or a parent run's spec): the inverse of `spec_from_form`."""
        form: dict[str, Any] = {}
        for form_field in self.fields:
            node: Any = spec
            for part in form_field.path.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            if node is None and not form_field.optional:
                node = form_field.default
            convert = _TO_FORM.get(form_field.path)
            form[form_field.path] = convert(node) if convert else form_field.to_form(node)
        storage = spec.get("storage") or {}
        form["bucket_kind"] = bucket_kind(storage.get("uri", ""), storage.get("endpoint"))
        form.update(_reward_inputs(spec.get("rewards") or [], (spec.get("eval") or {}).get("metrics") or []))
        return form

    # -- errors ----------------------------------------------------------------------------------------------------

    def label(
        self, dotted: str, rewards: list[dict[str, Any]] | None = None, metrics: list[dict[str, Any]] | None = None
    ) -> str:
        """The human label of an error key (a spec field, or one of preflight's own), never the raw key."""
        path = field_path(dotted)
        match = _FUNCTION.match(path)
        if match:
            kind, index, rest = match.group(1), int(match.group(2)), match.group(3)
            items = rewards if kind == "rewards" else metrics
            name = (items[index].get("name") if items and index < len(items) else None) or ""
            function = f"{_FUNCTION_WORD[kind]} {index + 1}" + (f" ({name})" if name else "")
            if rest is None:
                return function[0].upper() + function[1:]
            field_name = rest.split(".", 1)[0]
            known = self.item_labels.get("rewards", {}).get(field_name)
            return f"{known or _words(field_name).capitalize()} of {function}"
        known = self._field_label(path)
        if known is not None:
            return known
        head, _, rest = path.partition(".")
        section = self.labels.get(head, "Settings")
        return f"{section}: {_words(rest)}" if rest else f"{section}: {_words(head)}"

    def _field_label(self, path: str) -> str | None:
        """The label of `path`, or of the field it lies in (`lora.target_modules.0`, a union member such as
        `lora.target_modules.list[str]`): the longest labelled prefix that names a field, not only a section."""
        parts = path.split(".")
        for end in range(len(parts), 0, -1):
            prefix = ".".join(parts[:end])
            if prefix in self.labels and (end == len(parts) or prefix not in self._sections):
                return self.labels[prefix]
        return None

    def slot_of(
        self, dotted: str, reward_slots: list[str], code_enabled: bool, metric_slots: list[str] | None = None
    ) -> str:
        """Which note under the form shows an error about `dotted` (a field name from Preflight.errors)."""
        path = field_path(dotted)
        if any(path == name or path.startswith(name + ".") for name in self.advanced):
            return "advanced"
        match = _FUNCTION.match(path)
        slots = (reward_slots if match.group(1) == "rewards" else metric_slots or []) if match else []
        if match and int(match.group(2)) < len(slots):
            return slots[int(match.group(2))]
        if path.split(".", 1)[0] == "rewards" or path == "eval.metrics" or path.startswith("eval.metrics."):
            return "rewards_code" if code_enabled else "rewards_builtin"
        return self.section_slots.get(path.split(".", 1)[0], "general")

    def route_errors(self, errors: dict[str, str], built: Built | None, code_enabled: bool) -> dict[str, list[str]]:
        """{slot: ["Label: message", ...]} for every slot (empty lists included, so stale notes are cleared)."""
        routed: dict[str, list[str]] = {slot: [] for slot in SLOTS}
        slots = built.reward_slots if built else []
        rewards = built.spec.get("rewards") if built else None
        metrics = (built.spec.get("eval") or {}).get("metrics") if built else None
        for dotted, message in errors.items():
            # A function's own errors already start with its name ("custom (row 2): ..."): no label in front.
            whole_function = re.fullmatch(r"(rewards|eval\.metrics)\.\d+", field_path(dotted))
            text = message if whole_function else f"{self.label(dotted, rewards, metrics)}: {message}"
            metric_slots = built.metric_slots if built else []
            routed[self.slot_of(dotted, slots, code_enabled, metric_slots)].append(text)
        return routed


def _field(path: str, info: Any, hints: dict[str, Any], section: str) -> FormField:
    kind, options, optional = _kind(info.annotation)
    return FormField(
        path=path,
        label=info.title or path,
        help=info.description or "",
        section=section,
        advanced=bool(hints.get("advanced")),
        unset=hints.get("unset", ""),
        kind=kind,
        options=options,
        words=hints.get("choices") or {},
        optional=optional,
        default=None if info.is_required() else info.get_default(call_default_factory=True),
        limits=_limits(info.metadata),
    )


@dataclass
class Built:
    """A spec dict from the form, and for each entry of `rewards` the slot that shows its errors."""

    spec: dict[str, Any]
    reward_slots: list[str] = field(default_factory=list)
    metric_slots: list[str] = field(default_factory=list)  # for each entry of `eval.metrics`


def _text(value: Any) -> str | None:
    text = str(value).strip() if value is not None else ""
    return text or None


def _targets(value: Any, form: dict[str, Any]) -> str | list[str]:
    text = _text(value) or "all-linear"
    return text if text == "all-linear" else _listed(text, form)


def _listed(value: Any, form: dict[str, Any]) -> list[str]:
    """Names separated by commas (or spaces) in a text box, as a list."""
    return [name.strip() for name in re.split(r"[,;\s]+", _text(value) or "") if name.strip()]


def _listed_text(value: Any) -> str:
    return ", ".join(value or [])


def _targets_text(value: Any) -> str:
    if value is None:
        return "all-linear"
    return value if isinstance(value, str) else ", ".join(value)


def _on_hf_jobs(value: Any, form: dict[str, Any]) -> str | None:
    """The namespace is billed on HF Jobs only; on this machine it is not part of the run."""
    return _text(value) if form.get("compute.backend") == "hf_jobs" else None


def _flavor(value: Any, form: dict[str, Any]) -> str:
    return _text(value) or "cpu-basic"


def _for_kinds(*kinds: str) -> Callable[[Any, dict[str, Any]], str | None]:
    """A bucket field that only some kinds of bucket use (an endpoint for R2 and MinIO, a region for S3 ones)."""
    return lambda value, form: _text(value) if form.get("bucket_kind") in kinds else None


# Spec fields whose widget holds something else than the spec value, or whose value depends on another input.
_TO_SPEC: dict[str, Callable[[Any, dict[str, Any]], Any]] = {
    "lora.target_modules": _targets,
    "environment.packages": _listed,
    "compute.namespace": _on_hf_jobs,
    "compute.trainer_flavor": _flavor,
    "compute.replica_flavor": _flavor,
    "storage.endpoint": _for_kinds("r2", "minio"),
    "storage.region": _for_kinds("aws", "r2", "minio"),
}
_TO_FORM: dict[str, Callable[[Any], Any]] = {
    "lora.target_modules": _targets_text,
    "environment.packages": _listed_text,
}


def _credential(value: Any) -> int | None:
    return int(value) if value not in (None, "", "none") else None


def credentials(form: dict[str, Any]) -> RunCredentials:
    """The credentials the form selects."""
    keys = ("store_credential", "hf_credential", "wandb_credential")
    return RunCredentials(*(_credential(form.get(key)) for key in keys))


def rewards_of(form: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """The rewards the form holds, and for each the note that shows its errors."""
    rewards = [_builtin(name, form) for name in form.get("builtin_rewards") or []]
    slots = ["rewards_builtin"] * len(rewards)
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


def metrics_of(form: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """The eval metrics the form holds: built-ins (their parameters are the rewards'), and further functions of the
    reward code; for each, the note that shows its errors."""
    metrics = [_builtin(name, form) for name in form.get("builtin_metrics") or []]
    slots = ["rewards_builtin"] * len(metrics)
    if form.get("code_enabled"):
        for entry in _names(form.get("code_metrics")):
            metrics.append(
                {"kind": "code", "name": entry, "source": form.get("code_source") or "", "entry_point": entry}
            )
            slots.append("rewards_code")
    return metrics, slots


def _builtin(name: str, form: dict[str, Any]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if name == "format" and _text(form.get("format_tags")):
        params["tags"] = [t for t in re.split(r"[,\s]+", form["format_tags"]) if t]
    if name == "length" and form.get("length_target"):
        params["target"] = int(form["length_target"])
    if name == "regex":
        params["pattern"] = form.get("regex_pattern") or ""
    return {"kind": "builtin", "name": name, "params": params}


def _names(value: Any) -> list[str]:
    return [name for name in re.split(r"[,\s]+", str(value or "")) if name]


def _reward_inputs(rewards: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """The reward and metric inputs of the form for a spec's rewards and metrics: the inverse of `rewards_of` and
    `metrics_of` (a code metric's source is the code reward's)."""
    builtins = [r for r in [*rewards, *metrics] if r.get("kind", "builtin") == "builtin"]
    code = next((r for r in rewards if r.get("kind") == "code"), None) or {}
    params = {r["name"]: r.get("params") or {} for r in builtins}
    return {
        "builtin_rewards": [r["name"] for r in rewards if r.get("kind", "builtin") == "builtin"],
        "builtin_metrics": [m["name"] for m in metrics if m.get("kind", "builtin") == "builtin"],
        "code_metrics": ", ".join(m["name"] for m in metrics if m.get("kind") == "code"),
        "format_tags": " ".join(params.get("format", {}).get("tags", ["<think>", "</think>", "<answer>", "</answer>"])),
        "length_target": params.get("length", {}).get("target", 256),
        "regex_pattern": params.get("regex", {}).get("pattern", ""),
        "code_enabled": bool(code),
        "code_name": code.get("name", "custom"),
        "code_entry": code.get("entry_point", "reward"),
        "code_weight": code.get("weight", 1.0),
        "code_source": code.get("source") or CODE_TEMPLATE,
    }


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


def _words(name: str) -> str:
    """A field name nobody gave a label (a misspelt one, say) as words: `max_stalenes` -> `max stalenes`."""
    return re.sub(r"[_.\[\]]+", " ", name).strip()


def builtin_choices() -> list[tuple[str, str]]:
    return [(f"{name} — {BUILTIN_DESCRIPTIONS.get(name, '')}", name) for name in BUILTIN_REWARDS]


# The form of RunSpec, and its operations under the names the pages and tests use.
FORM = FormSchema(RunSpec)
KEYS = FORM.keys
LABELS = FORM.labels
spec_from_form = FORM.spec_from_form
form_from_spec = FORM.form_from_spec
label = FORM.label
slot_of = FORM.slot_of
route_errors = FORM.route_errors
