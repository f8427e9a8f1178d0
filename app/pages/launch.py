"""Launch: pick a preset, adjust model, data, rewards, bucket, compute and training, check it all, launch.

Nothing is launched before the backend's preflight passes: the Launch button is enabled only by a passing check of
exactly the settings on screen, and every error is shown right under the field it concerns. Bucket keys and tokens
typed here go straight to the vault; the form only ever shows them masked.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeAlias

import gradio as gr
import pandas as pd
from gradio.blocks import Block
from pydantic import ValidationError

from app import cards
from app.credential_choices import NONE, credential_choices
from app.events import Components, Updates, Values
from app.formatting import money
from app.launch_form import (
    BUCKET_HINTS,
    BUCKET_KINDS,
    FORM,
    SLOTS,
    FormField,
    FormSchema,
    builtin_choices,
    credentials,
    metrics_of,
    rewards_of,
)
from app.panel import Panel
from backend.api import PanelServices
from backend.launch import presets
from backend.launch.limits import LimitReached
from backend.launch.preflight import Preflight
from backend.sandbox.client import RewardTrial, SandboxError
from backend.services.runs import propose_run_id, run_id_taken
from jobs.contract import RewardSpec, RunSpec, derived, parse_spec, timeout_seconds
from jobs.contract.spec import MAX_REPLICAS, SpecError

PRESETS = {
    "demo": "Demo on this machine",
    "agent": "Agent demo (a tool to call)",
    "math": "Math sanity recipe on HF Jobs",
}
COMMON_FLAVORS = ["cpu-basic", "cpu-upgrade", "t4-small", "l4x1", "a10g-small", "a10g-large", "l40sx1", "a100-large",
                  "h100", "h200", "h200x2", "h200x4", "h200x8"]  # fmt: skip
PREVIEW_CHARS = 240
# Spec fields with a widget of their own (a radio, a slider, a flavor list) or shown only in some cases; every other
# field of the spec is generated in its section by `LaunchPage._generated`.
PLACED_BY_HAND = frozenset(
    {
        "run_id", "name", "model.id", "dataset.source", "dataset.id", "storage.uri", "storage.endpoint",
        "storage.region", "compute.backend", "compute.namespace", "compute.trainer_flavor", "compute.replica_flavor",
        "compute.replicas", "compute.timeout", "compute.queue_timeout",
    }
)  # fmt: skip
# The order of generated fields across the spec's sections: the training loop's settings before the adapter's.
_SPEC_ORDER = (
    "run_id",
    "name",
    "model",
    "dataset",
    "eval",
    "grpo",
    "environment",
    "lora",
    "compute",
    "storage",
    "reporting",
)
FIELDS_PER_ROW = 5
# Shown only when the jobs run on HF Jobs.
_HUB_ONLY = ("compute.namespace", "compute.trainer_flavor", "compute.replica_flavor", "compute.queue_timeout")
# What the cost estimate reads.
_COST_INPUTS = (
    "compute.backend", "hf_credential", "compute.trainer_flavor", "compute.replica_flavor", "compute.replicas",
    "compute.timeout",
)  # fmt: skip
FormWidget: TypeAlias = gr.Textbox | gr.Number | gr.Checkbox | gr.Dropdown | gr.Radio | gr.Slider | gr.Code
"""What a form field is shown in: a widget with a value, and `change` and `input` events."""
_GENERATED_WIDGETS: dict[str, Callable[..., FormWidget]] = {
    "bool": gr.Checkbox,
    "choice": gr.Dropdown,
    "int": gr.Number,
    "float": gr.Number,
    "text": gr.Textbox,
    "other": gr.Textbox,
}


def _widget_options(form_field: FormField) -> dict[str, Any]:
    """Limits are not given to the widget: Gradio would refuse an out-of-range number in a toast that names no
    field; the spec's check names it in place instead."""
    return {"precision": 0} if form_field.kind == "int" else {}


def _short(text: object, limit: int = PREVIEW_CHARS) -> str:
    text = str(text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, list):
        return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in prompt)
    return str(prompt)


def preview_table(rows: list[dict[str, Any]]) -> pd.DataFrame:
    if not rows:
        return pd.DataFrame({"": ["Press “Preview rows” (or Check settings) to load the first rows."]})
    columns = ["prompt", "answer"] + [k for k in rows[0] if k not in ("prompt", "answer")]
    data: dict[str, list[Any]] = {"#": list(range(1, len(rows) + 1))}
    for column in columns:
        data[column] = [
            _short(_prompt_text(row.get(column, "")) if column == "prompt" else row.get(column, "")) for row in rows
        ]
    return pd.DataFrame(data)


def trials_table(rows: list[dict[str, Any]], completions: list[str], trials: list[RewardTrial]) -> pd.DataFrame:
    data: dict[str, list[Any]] = {
        "#": list(range(1, len(rows) + 1)),
        "prompt": [_short(_prompt_text(row.get("prompt", "")), 120) for row in rows],
        "completion scored": [_short(c, 120) or "(empty)" for c in completions],
    }
    for trial in trials:
        if trial.error:
            where = trial.row if trial.row is not None else None
            data[trial.name] = ["error" if where is None or where == i else "—" for i in range(len(rows))]
        else:
            data[trial.name] = [f"{s:.3f}" if isinstance(s, int | float) else "—" for s in trial.scores]
    return pd.DataFrame(data)


class LaunchPage:
    def __init__(self, panel: Panel, form: FormSchema = FORM):
        self.panel = panel
        self.form = form
        self.initial: dict[str, Any] = {}
        self.inputs: dict[str, FormWidget] = {}
        self.slots: dict[str, gr.HTML] = {}

    # --- layout -------------------------------------------------------------------------------------------------

    def _slot(self, name: str) -> None:
        self.slots[name] = gr.HTML("", elem_id=f"error-{name}", padding=False, visible=False)

    def _field(self, path: str, component: Callable[..., FormWidget], **options: Any) -> FormWidget:
        """The widget of spec field `path`, of a kind the page chooses, labelled and explained by the spec."""
        form_field = self.form.by_path[path]
        if form_field.kind == "choice" and component in (gr.Radio, gr.Dropdown):
            options.setdefault("choices", form_field.choices())
        widget = component(
            value=self.initial[path],
            label=form_field.label,
            info=form_field.info or None,
            elem_id=form_field.elem_id,
            **options,
        )
        self.inputs[path] = widget
        return widget

    def _generated(self, section: str | None, advanced: bool = False) -> None:
        """Every field of `section` (of every section when None) the page does not lay out by hand, in rows."""
        fields = [
            form_field
            for form_field in self.form.fields
            if form_field.advanced == advanced
            and section in (None, form_field.section)
            and form_field.path not in PLACED_BY_HAND
        ]
        fields.sort(key=lambda form_field: _SPEC_ORDER.index(form_field.path.split(".")[0]))
        for start in range(0, len(fields), FIELDS_PER_ROW):
            with gr.Row(elem_classes="gp-fields"):
                for form_field in fields[start : start + FIELDS_PER_ROW]:
                    self._field(form_field.path, _GENERATED_WIDGETS[form_field.kind], **_widget_options(form_field))

    def build(self) -> None:
        initial = self.form.form_from_spec(self._preset_spec("demo", None))
        self.initial = initial
        i = self.inputs
        gr.Markdown(
            "Start from a preset, adjust what you need, press **Check settings** — the bucket, the dataset, the "
            "rewards and the cost are verified before anything starts — then **Launch**.",
        )
        with gr.Row(elem_classes="gp-align-end"):
            self.preset = gr.Radio(
                [(label, key) for key, label in PRESETS.items()],
                value="demo",
                label="Preset",
                scale=2,
                elem_id="preset",
            )
            self._field("run_id", gr.Textbox, scale=1)
            self._field("name", gr.Textbox, scale=1)
        self._generated("run")
        self._slot("run")

        gr.Markdown("### 1 · Model and data", elem_classes="gp-section-title")
        with gr.Row():
            self._field("model.id", gr.Textbox, scale=2)
            self._field("dataset.source", gr.Radio, scale=1)
            self._field("dataset.id", gr.Textbox, scale=2)
        self._generated("model")
        self._slot("model")
        self._generated("dataset")
        self._slot("dataset")
        with gr.Row():
            self.preview_button = gr.Button("Preview rows", size="sm", scale=0, min_width=140)
            gr.HTML('<span class="gp-meta">The first rows as the trainer will see them.</span>', padding=False)
        self.preview = gr.Dataframe(
            preview_table([]),
            label="Dataset preview",
            interactive=False,
            wrap=True,
            max_height=260,
            elem_id="dataset-preview",
        )

        gr.Markdown("### 2 · Rewards", elem_classes="gp-section-title")
        i["builtin_rewards"] = _builtin_picker(initial["builtin_rewards"], "Built-in rewards", "builtin-rewards")
        i["builtin_metrics"] = _builtin_picker(
            initial["builtin_metrics"],
            "Eval metrics (built-in): scored on the held-out prompts beside the rewards, never trained on",
            "builtin-metrics",
        )
        picked = {*initial["builtin_rewards"], *initial["builtin_metrics"]}
        with gr.Row():
            i["format_tags"] = gr.Textbox(
                initial["format_tags"], label="format: required tags, in order", visible="format" in picked
            )
            i["length_target"] = gr.Number(
                initial["length_target"], label="length: target tokens", precision=0, visible="length" in picked
            )
            i["regex_pattern"] = gr.Textbox(initial["regex_pattern"], label="regex: pattern", visible="regex" in picked)
        self._slot("rewards_builtin")
        i["code_enabled"] = gr.Checkbox(
            initial["code_enabled"], label="Add a reward written in Python", elem_id="code-enabled"
        )
        with gr.Group(visible=initial["code_enabled"]) as self.code_group:
            with gr.Row():
                i["code_name"] = gr.Textbox(initial["code_name"], label="Name (metric rewards/<name>)", scale=1)
                i["code_entry"] = gr.Textbox(initial["code_entry"], label="Function to call", scale=1)
                i["code_weight"] = gr.Number(initial["code_weight"], label="Weight", scale=1)
            i["code_source"] = gr.Code(
                initial["code_source"],
                language="python",
                lines=12,
                max_lines=30,
                label="Reward code",
                elem_id="reward-code",
            )
            i["code_metrics"] = gr.Textbox(
                initial["code_metrics"],
                label="Eval metrics in this code: names of further functions, scored on the held-out prompts, never "
                "trained on (e.g. exact_match)",
                elem_id="code-metrics",
            )
        self._slot("rewards_code")
        with gr.Row(elem_classes="gp-align-end"):
            self.completion = gr.Textbox(
                presets.SAMPLE_COMPLETIONS.get(self.preset.value, ""),
                label="Completion to score (optional)",
                elem_id="reward-completion",
                scale=3,
                placeholder="Leave empty to score each row's reference answer as if the model had written it",
            )
            self.test_rewards_button = gr.Button("Test on sample rows", elem_id="test-rewards", scale=0, min_width=240)
        self.trials = gr.Dataframe(
            visible=False, label="Scores on the sample rows", interactive=False, wrap=True, elem_id="reward-trials"
        )

        gr.Markdown("### 3 · Bucket", elem_classes="gp-section-title")
        uri_hint, endpoint_hint, region_hint = BUCKET_HINTS[initial["bucket_kind"]]
        with gr.Row():
            i["bucket_kind"] = gr.Radio(
                [(label, key) for key, label in BUCKET_KINDS.items()],
                value=initial["bucket_kind"],
                label="Kind",
                elem_id="bucket-kind",
                scale=3,
            )
            self._field("storage.uri", gr.Textbox, placeholder=uri_hint, scale=3)
        remote = initial["bucket_kind"] != "local"
        with gr.Row(visible=remote) as self.remote_row:
            self._field("storage.endpoint", gr.Textbox, placeholder=endpoint_hint)
            self._field("storage.region", gr.Textbox, placeholder=region_hint)
            i["store_credential"] = gr.Dropdown(
                credential_choices(None, "s3", "no keys"), value=NONE, label="Saved keys", elem_id="store-credential"
            )
        with gr.Row(visible=remote) as self.keys_row:
            self.access_key = gr.Textbox(
                label="Access key id",
                type="password",
                elem_id="access-key",
                placeholder="stored encrypted, shown masked",
            )
            self.secret_key = gr.Textbox(
                label="Secret access key",
                type="password",
                elem_id="secret-key",
                placeholder="stored encrypted, shown masked",
            )
        self._generated("storage")
        with gr.Row(elem_classes="gp-align-end"):
            self.test_connection_button = gr.Button(
                "Test connection", elem_id="test-connection", scale=0, min_width=170
            )
            gr.HTML(
                '<span class="gp-meta">Writes, reads back and deletes a probe object with these keys.</span>',
                padding=False,
            )
        self._slot("storage")

        gr.Markdown("### 4 · Compute", elem_classes="gp-section-title")
        hf = initial["compute.backend"] == "hf_jobs"
        with gr.Row():
            self._field("compute.backend", gr.Radio, scale=2)
            i["hf_credential"] = gr.Dropdown(
                credential_choices(None, "hf_token", "no token"),
                value=NONE,
                label="HF token",
                scale=2,
                elem_id="hf-credential",
                info="for HF Jobs, gated or private models, and publishing",
            )
            self._field("compute.namespace", gr.Textbox, visible=hf, scale=1)
        with gr.Row():
            for path in ("compute.trainer_flavor", "compute.replica_flavor"):
                self._field(path, gr.Dropdown, choices=COMMON_FLAVORS, allow_custom_value=True, visible=hf)
            self._field("compute.replicas", gr.Slider, minimum=1, maximum=MAX_REPLICAS, step=1)
            self._field("compute.timeout", gr.Textbox)
            self._field("compute.queue_timeout", gr.Textbox, visible=hf)
        self._generated("compute")
        self.cost = gr.HTML(self._cost_html(initial, None), elem_id="cost-estimate", padding=False)
        self._slot("compute")

        gr.Markdown("### 5 · Training", elem_classes="gp-section-title")
        self._generated("training")
        self._slot("training")

        gr.Markdown("### 6 · Reporting", elem_classes="gp-section-title")
        gr.Markdown(
            "The panel always shows the run. Tick Trackio or Weights & Biases to have the trainer report there too, "
            "under TRL's metric names."
        )
        self._generated("reporting")
        i["wandb_credential"] = gr.Dropdown(
            credential_choices(None, "wandb", "no key"),
            value=NONE,
            label="W&B key",
            elem_id="wandb-credential",
            info="saved on the Account page; given to the trainer job only, as a secret",
        )
        self._slot("reporting")
        with gr.Accordion("Advanced settings (the recipe's defaults)", open=False) as self.advanced:
            self._generated(None, advanced=True)
            self._slot("advanced")

        with gr.Column(elem_classes="gp-launch-bar"):
            self._slot("general")
            self.status = gr.HTML(
                cards.note("Press Check settings: Launch is enabled once every check passes."),
                elem_id="launch-status",
                padding=False,
            )
            with gr.Row():
                self.check_button = gr.Button("Check settings", elem_id="check", variant="secondary")
                self.launch_button = gr.Button("Launch", elem_id="launch", variant="primary", interactive=False)
            with gr.Accordion(
                "What Launch will submit", open=False, visible=False, elem_id="launch-plan"
            ) as self.plan_group:
                gr.Markdown(
                    "Every job, its command, image, flavor, secret names (never values) and the values derived for "
                    "the hardware — the same as `python -m backend plan` prints."
                )
                self.plan = gr.HTML("", padding=False)
            with gr.Accordion(
                "Smoke test on HF Jobs (one cpu-basic job, about a minute, fractions of a cent)",
                open=False,
                elem_id="smoke-test",
            ):
                gr.Markdown(
                    "Before renting GPUs: one cheap job with this run's image fetches our code from your bucket with "
                    "its own secrets, writes and reads a probe object, and answers through its public URL; then it "
                    "is cancelled. Each step is shown with its time. Same as `python -m backend smoke`."
                )
                self.smoke_button = gr.Button("Run the smoke test", elem_id="smoke-run", size="sm")
                self.smoke_result = gr.HTML("", padding=False, elem_id="smoke-result")
        self.checked = gr.State("")  # the spec JSON of the last passing check
        self.rows = gr.State([])  # the dataset rows of the last preview
        assert set(self.inputs) == set(self.form.keys), set(self.form.keys) ^ set(self.inputs)
        self._wire()

    # --- wiring -------------------------------------------------------------------------------------------------

    def _form_inputs(self) -> set[Block]:
        return set(self.inputs.values())

    def _form(self, values: Values) -> dict[str, Any]:
        return {key: values[component] for key, component in self.inputs.items()}

    def _wire(self) -> None:
        i = self.inputs
        self.preset.change(self.apply_preset, [self.preset], self._preset_outputs())
        i["bucket_kind"].input(
            self.on_bucket_kind,
            [i["bucket_kind"], i["storage.uri"]],
            [i["storage.uri"], i["storage.endpoint"], i["storage.region"], self.remote_row, self.keys_row],
        )
        for builtins in (i["builtin_rewards"], i["builtin_metrics"]):  # a built-in's parameters serve both
            builtins.change(
                lambda rewards, metrics: [
                    gr.update(visible=n in {*(rewards or []), *(metrics or [])}) for n in ("format", "length", "regex")
                ],
                [i["builtin_rewards"], i["builtin_metrics"]],
                [i["format_tags"], i["length_target"], i["regex_pattern"]],
            )
        i["code_enabled"].change(lambda on: gr.Group(visible=on), [i["code_enabled"]], [self.code_group])
        i["compute.backend"].change(
            lambda backend: [gr.update(visible=backend == "hf_jobs")] * len(_HUB_ONLY),
            [i["compute.backend"]],
            [i[key] for key in _HUB_ONLY],
        )
        cost_inputs = [i[key] for key in _COST_INPUTS]
        for component in cost_inputs:
            component.change(
                self.estimate_cost,
                {*cost_inputs},
                [self.cost, i["compute.trainer_flavor"], i["compute.replica_flavor"]],
                show_progress="hidden",
            )
        for component in self.inputs.values():
            component.input(
                self.mark_changed,
                [self.checked],
                [self.launch_button, self.status, self.plan_group],
                show_progress="hidden",
                trigger_mode="always_last",
            )
        self.preview_button.click(self.check, {*self._form_inputs()}, self._check_outputs())
        self.check_button.click(self.check, {*self._form_inputs()}, self._check_outputs())
        self.test_rewards_button.click(
            self.test_rewards,
            {*self._form_inputs(), self.rows, self.completion},
            [self.trials, self.slots["rewards_builtin"], self.slots["rewards_code"], self.rows, self.preview],
        )
        self.smoke_button.click(self.smoke_test, {*self._form_inputs(), self.checked}, [self.smoke_result])
        self.test_connection_button.click(
            self.test_connection,
            {*self._form_inputs(), self.access_key, self.secret_key},
            [self.slots["storage"], i["store_credential"], self.access_key, self.secret_key],
        )

    def _check_outputs(self) -> Components:
        return [
            *self.slots.values(),
            self.preview,
            self.trials,
            self.cost,
            self.launch_button,
            self.status,
            self.advanced,
            self.checked,
            self.rows,
            self.plan_group,
            self.plan,
        ]

    def load_outputs(self) -> Components:
        """What refreshes when the page is opened: the credential dropdowns (they may have changed elsewhere), and
        the run id when a run has taken it meanwhile (a page reloaded after a launch still shows the launched id)."""
        return [
            self.inputs["store_credential"],
            self.inputs["hf_credential"],
            self.inputs["wandb_credential"],
            self.inputs["run_id"],
        ]

    def on_open(
        self, store_value: str, hf_value: str, wandb_value: str, run_id: str, profile: gr.OAuthProfile | None
    ) -> Updates:
        services = self.panel.services_or_none(profile)
        run_id = (run_id or "").strip()
        fresh: Updates = {}
        if not run_id or run_id_taken(self.panel.ctx, run_id):
            fresh = {self.inputs["run_id"]: propose_run_id(self.panel.ctx, run_id.split("-")[0] or "run")}
        store = credential_choices(services, "s3", "no keys")
        token = credential_choices(services, "hf_token", "no token")
        store_value = store_value if store_value in {v for _, v in store} else NONE
        hf_value = hf_value if hf_value in {v for _, v in token} else _default(token)
        wandb = credential_choices(services, "wandb", "no key")
        wandb_value = wandb_value if wandb_value in {v for _, v in wandb} else _default(wandb)
        return fresh | {
            self.inputs["store_credential"]: gr.Dropdown(choices=store, value=store_value),
            self.inputs["hf_credential"]: gr.Dropdown(choices=token, value=hf_value),
            self.inputs["wandb_credential"]: gr.Dropdown(choices=wandb, value=wandb_value),
        }

    # --- handlers -----------------------------------------------------------------------------------------------

    def _preset_spec(self, preset: str, owner: str | None) -> dict[str, Any]:
        if preset == "math":
            namespace = owner if owner and owner != "local" else "your-namespace"
            return presets.math_recipe(propose_run_id(self.panel.ctx, "math"), namespace, "grpo-runs")
        store = f"file://{self.panel.ctx.folder / 'store'}"
        return presets.LOCAL[preset](propose_run_id(self.panel.ctx, preset), store)

    def _preset_outputs(self) -> Components:
        return [
            *self.inputs.values(),
            *self.slots.values(),
            self.launch_button,
            self.status,
            self.code_group,
            self.remote_row,
            self.keys_row,
            self.cost,
            self.trials,
            self.preview,
            self.completion,
        ]

    def apply_preset(self, preset: str, profile: gr.OAuthProfile | None = None) -> Updates:
        form = self.form.form_from_spec(self._preset_spec(preset, self.panel.owner(profile)))
        kind = form["bucket_kind"]
        remote = kind != "local"
        uri_hint, endpoint_hint, region_hint = BUCKET_HINTS[kind]
        i = self.inputs
        updates: Updates = {i[key]: value for key, value in form.items()}
        updates |= {
            i["storage.uri"]: gr.update(value=form["storage.uri"], placeholder=uri_hint),
            i["storage.endpoint"]: gr.update(
                value=form["storage.endpoint"], placeholder=endpoint_hint, interactive=kind in ("r2", "minio")
            ),
            i["storage.region"]: gr.update(
                value=form["storage.region"], placeholder=region_hint, interactive=kind in ("aws", "r2", "minio")
            ),
            **{i[key]: gr.update(value=form[key], visible=form["compute.backend"] == "hf_jobs") for key in _HUB_ONLY},
            **{
                i[key]: gr.update(value=form[key], visible=key.split("_")[0] in form["builtin_rewards"])
                for key in ("format_tags", "length_target", "regex_pattern")
            },
        }
        return updates | {
            **{slot: _errors([]) for slot in self.slots.values()},
            self.launch_button: gr.Button(interactive=False),
            self.status: cards.note("Preset loaded. Press Check settings: Launch is enabled once every check passes."),
            self.completion: presets.SAMPLE_COMPLETIONS.get(preset, ""),
            self.code_group: gr.Group(visible=form["code_enabled"]),
            self.remote_row: gr.Row(visible=remote),
            self.keys_row: gr.Row(visible=remote),
            self.cost: self._cost_html(form, None),
            self.trials: gr.Dataframe(visible=False),
            self.preview: preview_table([]),
        }

    def on_bucket_kind(self, kind: str, uri: str) -> Updates:
        uri_hint, endpoint_hint, region_hint = BUCKET_HINTS[kind]
        scheme = {"local": "file://", "hf": "hf://"}.get(kind, "s3://")
        remote = kind != "local"
        i = self.inputs
        return {
            i["storage.uri"]: gr.update(placeholder=uri_hint, value=uri if uri.startswith(scheme) else ""),
            i["storage.endpoint"]: gr.update(placeholder=endpoint_hint, interactive=kind in ("r2", "minio")),
            i["storage.region"]: gr.update(placeholder=region_hint, interactive=kind in ("aws", "r2", "minio")),
            self.remote_row: gr.Row(visible=remote),
            self.keys_row: gr.Row(visible=remote),
        }

    def mark_changed(self, checked: str) -> Updates:
        if not checked:
            return {self.launch_button: gr.Button(interactive=False)}
        return self._launch_status("Settings changed since the last check: press Check settings again.", "warn") | {
            self.plan_group: gr.Accordion(visible=False)  # the plan shown was that of the settings checked
        }

    def _prices(self, values: dict[str, Any], services: PanelServices | None) -> tuple[dict[str, float] | None, str]:
        credential = values.get("hf_credential")
        if values.get("compute.backend") != "hf_jobs":
            return None, ""
        if not credential or services is None:
            return None, "Select an HF token to see the Hub's live prices."
        try:
            return services.flavor_prices(int(credential)), ""
        except Exception as error:  # the Hub is unreachable or refuses the token: say so, keep the form usable
            return None, f"Could not read prices from the Hub: {error}"

    def _cost_html(self, form: dict[str, Any], prices: dict[str, float] | None, problem: str = "") -> str:
        if form.get("compute.backend") != "hf_jobs":
            return cards.cost_line("$0.00/h", "— runs on this machine's CPU")
        if prices is None:
            return cards.cost_line("$—/h", problem)
        trainer, replica = form.get("compute.trainer_flavor"), form.get("compute.replica_flavor")
        count = int(form.get("compute.replicas") or 1)
        if trainer not in prices or replica not in prices:
            unknown = trainer if trainer not in prices else replica
            return cards.cost_line("$—/h", f"the Hub has no flavor {unknown!r}")
        total = prices[trainer] + count * prices[replica]
        try:
            hours = timeout_seconds(form.get("compute.timeout") or "4h") / 3600
            cap = f" · at most {money(total * hours)} for the timeout"
        except ValueError:
            cap = ""
        return cards.cost_line(
            money(total, per_hour=True),
            f"trainer {trainer} {money(prices[trainer], per_hour=True)} + {count} × {replica} "
            f"{money(prices[replica], per_hour=True)}{cap}",
        )

    def estimate_cost(self, values: Values, profile: gr.OAuthProfile | None = None) -> Updates:
        form = {key: values[self.inputs[key]] for key in _COST_INPUTS}
        prices, problem = self._prices(form, self.panel.services_or_none(profile))
        flavors = sorted(prices) if prices else COMMON_FLAVORS
        return {
            self.cost: self._cost_html(form, prices, problem),
            self.inputs["compute.trainer_flavor"]: gr.Dropdown(choices=flavors),
            self.inputs["compute.replica_flavor"]: gr.Dropdown(choices=flavors),
        }

    def check(self, values: Values, profile: gr.OAuthProfile | None = None) -> Updates:
        """Run the backend's preflight on the form; enable Launch only if it passes."""
        services = self.panel.services(profile)
        form = self._form(values)
        built = self.form.spec_from_form(form)
        try:
            result = services.preflight(built.spec, *credentials(form))
        except LimitReached as error:
            raise gr.Error(str(error)) from None
        routed = self.form.route_errors(result.errors, built, bool(form["code_enabled"]))
        open_advanced = bool(routed["advanced"])
        rows = [dict(row) for row in result.preview]
        trials = (
            gr.Dataframe(trials_table(rows, [str(r.get("answer") or "") for r in rows], result.trials), visible=True)
            if result.trials
            else gr.Dataframe(visible=False)
        )
        cost = (
            self._cost_html(form, None, "the estimate needs the Hub's prices: select an HF token")
            if result.cost_per_hour is None
            else self._cost_total(form, result)
        )
        return {
            **{self.slots[slot]: _errors(routed[slot]) for slot in SLOTS},
            self.preview: preview_table(rows),
            self.trials: trials,
            self.cost: cost,
            self.launch_button: gr.Button(interactive=result.ok),
            self.status: check_status(result),
            self.advanced: gr.Accordion(open=True) if open_advanced else gr.update(),
            self.checked: self._fingerprint(form) if result.ok else "",
            self.rows: rows,
            self.plan_group: gr.Accordion(visible=result.plan is not None),
            self.plan: cards.json_block(result.plan) if result.plan is not None else "",
        }

    def _cost_total(self, form: dict[str, Any], result: Preflight) -> str:
        if form.get("compute.backend") != "hf_jobs":
            return self._cost_html(form, None)
        return cards.cost_line(money(result.cost_per_hour, per_hour=True), "at the Hub's current prices")

    def test_rewards(self, values: Values, profile: gr.OAuthProfile | None = None) -> Updates:
        """Score sample rows with the rewards and eval metrics on screen, in the sandbox; each error goes next to its
        function."""
        services = self.panel.services(profile)
        form = self._form(values)
        code_enabled = bool(form["code_enabled"])
        rewards, reward_slots = rewards_of(form)
        metrics, metric_slots = metrics_of(form)
        function_slots = [*reward_slots, *metric_slots]
        errors: dict[str, list[str]] = {"rewards_builtin": [], "rewards_code": []}
        specs = []
        for index, function in enumerate([*rewards, *metrics]):
            try:
                specs.append(RewardSpec.model_validate(function))
            except ValidationError as error:
                message = "; ".join(e["msg"].removeprefix("Value error, ") for e in error.errors())
                errors[function_slots[index]].append(f"{function['name']}: {message}")
        if not rewards:
            errors["rewards_builtin"].append("Pick at least one built-in reward or add one written in Python.")
        rows = values[self.rows]
        preview = gr.update()
        if not rows and specs and not any(errors.values()):
            result = services.preflight(self.form.spec_from_form(form).spec, *credentials(form))
            rows = [dict(row) for row in result.preview]
            preview = preview_table(rows)
            if not rows:
                reason = next((m for f, m in result.errors.items() if f.startswith("dataset")), "fix the dataset")
                errors["rewards_code" if code_enabled else "rewards_builtin"].append(
                    f"No sample rows to score: {reason}"
                )
        table = gr.Dataframe(visible=False)
        if rows and specs and not any(errors.values()):
            completions = [values[self.completion] or str(row.get("answer") or "") for row in rows]
            try:
                trials = services.test_rewards(specs, rows, completions)
            except (SandboxError, LimitReached) as error:
                errors["rewards_code" if code_enabled else "rewards_builtin"].append(str(error))
            else:
                table = gr.Dataframe(trials_table(rows, completions, trials), visible=True)
                for slot, trial in zip(function_slots, trials, strict=True):
                    if trial.error:
                        where = f" (row {trial.row + 1})" if trial.row is not None else ""
                        errors[slot].append(f"{trial.name}{where}: {trial.error}")
        return {
            self.trials: table,
            self.slots["rewards_builtin"]: _errors(errors["rewards_builtin"]),
            self.slots["rewards_code"]: _errors(errors["rewards_code"]),
            self.rows: rows,
            self.preview: preview,
        }

    def test_connection(self, values: Values, profile: gr.OAuthProfile | None = None) -> Updates:
        """Save typed keys to the vault (never echoed back), then probe the bucket with them."""
        services = self.panel.services(profile)
        form = self._form(values)
        access_key, secret_key = (values[self.access_key] or "").strip(), (values[self.secret_key] or "").strip()
        credential_id = credentials(form).store
        kind = form["bucket_kind"]
        if kind != "local" and access_key and secret_key:
            name = f"{BUCKET_KINDS[kind]} · {_bucket_name(form['storage.uri'])}"
            credential = services.credentials.save(
                services.owner, name, "s3", {"access_key_id": access_key, "secret_access_key": secret_key}
            )
            credential_id = credential.id
        elif kind != "local" and (access_key or secret_key):
            return {self.slots["storage"]: _errors(["Bucket keys: enter both the access key id and the secret."])}
        built = self.form.spec_from_form(form).spec["storage"]
        try:
            where = services.test_connection(
                built["uri"], built.get("endpoint"), built.get("region"), credential_id if kind != "local" else None
            )
            result = gr.HTML(
                cards.note(f"Connected: {where} accepted a write, a read and a delete.", "good"), visible=True
            )
        except Exception as error:  # StoreAccessError, a malformed URI, ...: the message names the problem
            result = _errors([f"Connection failed: {error}"])
        choices = credential_choices(services, "s3", "no keys")
        value = str(credential_id) if credential_id is not None and kind != "local" else NONE
        return {
            self.slots["storage"]: result,
            self.inputs["store_credential"]: gr.Dropdown(choices=choices, value=value),
            self.access_key: "",  # typed keys are never shown back: they are in the vault now
            self.secret_key: "",
        }

    def smoke_test(self, values: Values, profile: gr.OAuthProfile | None = None) -> str:
        """Run the smoke test on the settings that passed the check (it submits a job: no unchecked settings)."""
        services = self.panel.services(profile)
        form = self._form(values)
        checked = values[self.checked]
        if form.get("compute.backend") != "hf_jobs":
            return cards.note("The smoke test runs on Hugging Face Jobs; choose it under Compute first.", "warn")
        if not checked or checked != self._fingerprint(form):
            return cards.note("Press Check settings first: the smoke test runs the settings that passed it.", "warn")
        chosen = credentials(form)
        spec = RunSpec.model_validate(json.loads(checked)["spec"])
        try:
            report = services.smoke_test(spec, chosen.store, chosen.hf)
        except (ValueError, LimitReached) as error:  # a credential not this owner's, no bucket keys, too many at once
            return cards.note(f"Smoke test not started: {error}", "bad")
        return cards.smoke_report(report)

    def launch(self, values: Values, profile: gr.OAuthProfile | None = None) -> tuple[str | None, Updates]:
        """Create and start the run whose settings passed the check; returns its id (None if nothing launched)."""
        services = self.panel.services(profile)
        form = self._form(values)
        checked = values[self.checked]
        if not checked or checked != self._fingerprint(form):
            return None, self._launch_status(
                "Settings changed since the last check: press Check settings again.", "warn"
            )
        try:
            spec = RunSpec.model_validate(json.loads(checked)["spec"])
            run = services.runs.create(spec, *credentials(form))
            services.runs.launch(run.id)
        except Exception as error:  # run id taken since the check, bucket gone, ...
            return None, self._launch_status(f"Not launched: {error}", "bad")
        return run.id, self._launch_status(f"Launched {run.id}: its jobs are starting. Opening the monitor…", "good")

    def _launch_status(self, message: str, tone: str) -> Updates:
        """After Launch was pressed it stays disabled: a launched run needs a new check, a refused one too."""
        return {self.launch_button: gr.Button(interactive=False), self.status: cards.note(message, tone)}

    def _fingerprint(self, form: dict[str, Any]) -> str:
        """What a passing check vouches for: the validated spec and the credentials chosen with it."""
        try:
            spec = json.loads(parse_spec(self.form.spec_from_form(form).spec).to_json())
        except SpecError:
            return ""
        return json.dumps({"spec": spec, "credentials": list(credentials(form))}, sort_keys=True)

    def wire_launch(self, navigate: Callable[[str, gr.OAuthProfile | None], Updates], outputs: Components) -> None:
        """Launch, then open the new run: `navigate(run_id, profile)` gives the updates for `outputs`."""

        def launch_and_open(values: Values, profile: gr.OAuthProfile | None = None) -> Updates:
            run_id, updates = self.launch(values, profile)
            if not run_id:
                return updates
            fresh = propose_run_id(self.panel.ctx, run_id.split("-")[0])
            launched = cards.note(
                f"Launched {run_id}: its jobs are starting, on the Monitor. This form now proposes {fresh} for "
                "another run: Check settings to launch it.",
                "good",
            )
            return (
                updates
                | {self.checked: "", self.inputs["run_id"]: fresh, self.status: launched}
                | navigate(run_id, profile)
            )

        self.launch_button.click(
            launch_and_open,
            {*self._form_inputs(), self.checked},
            [self.launch_button, self.status, self.checked, self.inputs["run_id"], *outputs],
        )


CHECKED = ("bucket", "model", "dataset", "rewards", "compute")


def _builtin_picker(value: list[str], label: str, elem_id: str) -> gr.Dropdown:
    """The built-in reward functions to pick from, as rewards or as eval metrics."""
    return gr.Dropdown(builtin_choices(), value=value, multiselect=True, label=label, elem_id=elem_id)


def check_status(result: Preflight) -> str:
    """Check settings' verdict. What could not be checked is said as such, as prominently as an error, and never
    counted among what passed: offline, "All checks passed" once covered a dataset and rewards nobody had tried."""
    spec = result.checked_spec
    if spec is None:
        count = len(result.errors)
        return cards.note(
            f"{count} problem{'s' if count != 1 else ''} to fix (shown next to each field). Launch stays disabled "
            "until Check settings passes.",
            "bad",
        )
    notes = f" Note: {'; '.join(result.warnings)}." if result.warnings else ""
    if result.held_out is not None:
        held = result.held_out
        notes += f" Versions can be evaluated on {len(held.rows)} held-out prompts ({held.source})."
        metrics = [metric.name for metric in spec.eval.metrics]
        if metrics:
            notes += f" Scored beside the rewards, never trained on: {', '.join(metrics)}."
        if spec.eval.during_run:
            cost = derived.eval_cost(spec, len(held.rows))
            start = ", the parent version it starts from (v1)" if spec.parent is not None else ""
            notes += (
                f" During the run: the base model{start}, every {cost.every} versions and the last "
                f"({cost.evaluations} evaluations, {cost.token_share:.0%} of the rollout tokens at most)."
            )
    if not result.unchecked:
        return cards.note(f"All checks passed: {', '.join(CHECKED)}. Launch is enabled.{notes}", "good")
    passed = [name for name in CHECKED if name not in result.unchecked]
    missing = "; ".join(f"{name}: {why}" for name, why in result.unchecked.items())
    return cards.note(
        f"Not checked: {missing}. Passed: {', '.join(passed)}. Launch is enabled, since HF Jobs may reach what this "
        f"panel could not; if they cannot, the run fails at its start.{notes}",
        "warn",
    )


def _errors(messages: list[str]) -> gr.HTML:
    """A field's error note: shown with its messages, hidden (taking no room) when there are none."""
    return gr.HTML(cards.field_error(messages), visible=bool(messages))


def _bucket_name(uri: str) -> str:
    rest = uri.split("://", 1)[-1].removeprefix("buckets/")
    return rest.strip("/") or "bucket"


def _default(choices: list[tuple[str, str]]) -> str:
    """The only saved token, if there is exactly one (most people have one)."""
    saved = [value for _, value in choices if value != NONE]
    return saved[0] if len(saved) == 1 else NONE
