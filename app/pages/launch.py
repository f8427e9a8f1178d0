"""Launch: pick a preset, adjust model, data, rewards, bucket, compute and training, check it all, launch.

Nothing is launched before the backend's preflight passes: the Launch button is enabled only by a passing check of
exactly the settings on screen, and every error is shown right under the field it concerns. Bucket keys and tokens
typed here go straight to the vault; the form only ever shows them masked.
"""

from __future__ import annotations

import json
from typing import Any

import gradio as gr
import pandas as pd
from pydantic import ValidationError

from app import cards
from app.credential_choices import NONE, credential_choices
from app.formatting import money
from app.launch_form import (
    BUCKET_HINTS,
    BUCKET_KINDS,
    KEYS,
    SLOTS,
    builtin_choices,
    credentials,
    form_from_spec,
    new_run_id,
    rewards_of,
    route_errors,
    slot_of,
    spec_from_form,
)
from app.panel import Panel
from backend import presets
from backend.api import PanelServices
from backend.limits import LimitReached
from backend.sandbox import SandboxError
from jobs.contract import RewardSpec, RunSpec, parse_spec, timeout_seconds
from jobs.contract.spec import SpecError

PRESETS = {"demo": "Demo on this machine", "math": "Math sanity recipe on HF Jobs"}
COMMON_FLAVORS = ["cpu-basic", "cpu-upgrade", "t4-small", "l4x1", "a10g-small", "a10g-large", "l40sx1", "a100-large",
                  "h100", "h200", "h200x2", "h200x4", "h200x8"]  # fmt: skip
PREVIEW_CHARS = 240


def _short(text: Any, limit: int = PREVIEW_CHARS) -> str:
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
    data = {"#": list(range(1, len(rows) + 1))}
    for column in columns:
        data[column] = [
            _short(_prompt_text(row.get(column, "")) if column == "prompt" else row.get(column, "")) for row in rows
        ]
    return pd.DataFrame(data)


def trials_table(rows: list[dict[str, Any]], completions: list[str], trials: list) -> pd.DataFrame:
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
    def __init__(self, panel: Panel):
        self.panel = panel
        self.inputs: dict[str, gr.components.Component] = {}
        self.slots: dict[str, gr.HTML] = {}

    # --- layout -------------------------------------------------------------------------------------------------

    def _slot(self, name: str) -> None:
        self.slots[name] = gr.HTML("", elem_id=f"error-{name}", padding=False, visible=False)

    def build(self) -> None:
        initial = form_from_spec(self._preset_spec("demo", None))
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
            i["run_id"] = gr.Textbox(
                initial["run_id"],
                label="Run id",
                elem_id="run-id",
                scale=1,
                info="3-48 lowercase letters, digits and '-'",
            )
            i["name"] = gr.Textbox(initial["name"], label="Name", scale=1)
        self._slot("run")

        gr.Markdown("### 1 · Model and data", elem_classes="gp-section-title")
        with gr.Row():
            i["model_id"] = gr.Textbox(
                initial["model_id"],
                label="Model",
                elem_id="model-id",
                scale=2,
                info="Hub id (owner/name), an absolute local path, or builtin:tiny-qwen2",
            )
            i["dataset_source"] = gr.Radio(
                [("Hub", "hub"), ("File in the bucket", "store"), ("Built-in", "builtin")],
                value=initial["dataset_source"],
                label="Dataset source",
                scale=1,
            )
            i["dataset_id"] = gr.Textbox(
                initial["dataset_id"],
                label="Dataset",
                elem_id="dataset-id",
                scale=2,
                info="owner/name on the Hub, a path in the bucket, or 'digits'",
            )
        self._slot("model")
        with gr.Row():
            i["dataset_split"] = gr.Textbox(initial["dataset_split"], label="Split", scale=1)
            i["prompt_column"] = gr.Textbox(initial["prompt_column"], label="Prompt column", scale=1)
            i["answer_column"] = gr.Textbox(
                initial["answer_column"],
                label="Answer column",
                scale=1,
                info="passed to rewards as `answer`; a.b reaches into a struct column",
            )
            i["dataset_limit"] = gr.Number(
                initial["dataset_limit"], label="Row limit (0 = all)", precision=0, minimum=0, scale=1
            )
        i["system_prompt"] = gr.Textbox(initial["system_prompt"], label="System prompt (optional)", lines=1)
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
        i["builtin_rewards"] = gr.Dropdown(
            builtin_choices(),
            value=initial["builtin_rewards"],
            multiselect=True,
            label="Built-in rewards",
            elem_id="builtin-rewards",
        )
        with gr.Row():
            i["format_tags"] = gr.Textbox(
                initial["format_tags"],
                label="format: required tags, in order",
                visible="format" in initial["builtin_rewards"],
            )
            i["length_target"] = gr.Number(
                initial["length_target"],
                label="length: target tokens",
                precision=0,
                visible="length" in initial["builtin_rewards"],
            )
            i["regex_pattern"] = gr.Textbox(
                initial["regex_pattern"], label="regex: pattern", visible="regex" in initial["builtin_rewards"]
            )
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
        self._slot("rewards_code")
        with gr.Row(elem_classes="gp-align-end"):
            self.completion = gr.Textbox(
                label="Completion to score (optional)",
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
            i["storage_uri"] = gr.Textbox(
                initial["storage_uri"], label="Location", placeholder=uri_hint, elem_id="storage-uri", scale=3
            )
        remote = initial["bucket_kind"] != "local"
        with gr.Row(visible=remote) as self.remote_row:
            i["storage_endpoint"] = gr.Textbox(
                initial["storage_endpoint"], label="Endpoint", placeholder=endpoint_hint, elem_id="storage-endpoint"
            )
            i["storage_region"] = gr.Textbox(
                initial["storage_region"], label="Region", placeholder=region_hint, elem_id="storage-region"
            )
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
        hf = initial["backend"] == "hf_jobs"
        with gr.Row():
            i["backend"] = gr.Radio(
                [("This machine (local processes)", "local"), ("Hugging Face Jobs", "hf_jobs")],
                value=initial["backend"],
                label="Where the jobs run",
                elem_id="backend",
                scale=2,
            )
            i["hf_credential"] = gr.Dropdown(
                credential_choices(None, "hf_token", "no token"),
                value=NONE,
                label="HF token",
                scale=2,
                elem_id="hf-credential",
                info="for HF Jobs, gated or private models, and publishing",
            )
            i["namespace"] = gr.Textbox(initial["namespace"], label="Namespace (billed)", visible=hf, scale=1)
        with gr.Row():
            i["trainer_flavor"] = gr.Dropdown(
                COMMON_FLAVORS,
                value=initial["trainer_flavor"],
                allow_custom_value=True,
                label="Trainer hardware",
                visible=hf,
            )
            i["replica_flavor"] = gr.Dropdown(
                COMMON_FLAVORS,
                value=initial["replica_flavor"],
                allow_custom_value=True,
                label="Replica hardware",
                visible=hf,
            )
            i["replicas"] = gr.Slider(
                1, 16, value=initial["replicas"], step=1, label="Inference replicas", elem_id="replicas"
            )
            i["timeout"] = gr.Textbox(initial["timeout"], label="Timeout", info="e.g. 90m, 4h")
            i["queue_timeout"] = gr.Textbox(
                initial["queue_timeout"],
                label="Queue limit",
                info="how long a replica may wait for its hardware",
                visible=hf,
            )
        self.cost = gr.HTML(self._cost_html(initial, None), elem_id="cost-estimate", padding=False)
        self._slot("compute")

        gr.Markdown("### 5 · Training", elem_classes="gp-section-title")
        with gr.Row():
            i["max_steps"] = gr.Number(
                initial["max_steps"], label="Max steps", precision=0, minimum=1, elem_id="max-steps"
            )
            i["num_generations"] = gr.Number(initial["num_generations"], label="Generations per prompt", precision=0)
            i["completions_per_step"] = gr.Number(
                initial["completions_per_step"], label="Completions per step", precision=0
            )
            i["max_completion_length"] = gr.Number(
                initial["max_completion_length"], label="Max completion tokens", precision=0
            )
        with gr.Row():
            i["learning_rate"] = gr.Number(initial["learning_rate"], label="Learning rate")
            i["max_staleness"] = gr.Number(initial["max_staleness"], label="Max staleness (versions)", precision=0)
            i["lora_rank"] = gr.Number(initial["lora_rank"], label="LoRA rank", precision=0)
            i["lora_alpha"] = gr.Number(initial["lora_alpha"], label="LoRA alpha")
            i["lora_targets"] = gr.Textbox(
                initial["lora_targets"], label="Target modules", info="all-linear, or names separated by commas"
            )
        self._slot("training")
        with gr.Accordion("Advanced settings (the recipe's defaults)", open=False) as self.advanced:
            with gr.Row():
                i["temperature"] = gr.Number(initial["temperature"], label="Temperature")
                i["top_p"] = gr.Number(initial["top_p"], label="Top-p")
                i["top_k"] = gr.Number(initial["top_k"], label="Top-k (0 = off)", precision=0)
                i["weight_sync_steps"] = gr.Number(
                    initial["weight_sync_steps"], label="Weight sync every (steps)", precision=0
                )
                i["max_inflight"] = gr.Number(initial["max_inflight"], label="Max in flight", precision=0)
            with gr.Row():
                i["queue_size"] = gr.Number(initial["queue_size"], label="Queue size (0 = auto)", precision=0)
                i["token_budget"] = gr.Number(initial["token_budget"], label="Token budget (0 = off)", precision=0)
                i["save_steps"] = gr.Number(initial["save_steps"], label="Checkpoint every (steps)", precision=0)
                i["audit_every"] = gr.Number(initial["audit_every"], label="Policy audit every (versions)", precision=0)
                i["seed"] = gr.Number(initial["seed"], label="Seed", precision=0)
            with gr.Row():
                i["adam_beta2"] = gr.Number(initial["adam_beta2"], label="Adam β2")
                i["epsilon"] = gr.Number(initial["epsilon"], label="Clip ε")
                i["lora_dropout"] = gr.Number(initial["lora_dropout"], label="LoRA dropout")
                i["gradient_checkpointing"] = gr.Checkbox(
                    initial["gradient_checkpointing"], label="Gradient checkpointing"
                )
            with gr.Row():
                i["max_model_len"] = gr.Number(initial["max_model_len"], label="Max model length", precision=0)
                i["dtype"] = gr.Dropdown(
                    ["auto", "bfloat16", "float16", "float32"], value=initial["dtype"], label="Dtype"
                )
                i["model_revision"] = gr.Textbox(initial["model_revision"], label="Model revision")
                i["engine"] = gr.Dropdown(
                    [("auto", "auto"), ("vLLM", "vllm"), ("CPU engine", "cpu")],
                    value=initial["engine"],
                    label="Inference engine",
                )
                i["cost_cap"] = gr.Number(initial["cost_cap"], label="Cost cap $ (0 = none)", minimum=0)
            with gr.Row():
                i["trainer_image"] = gr.Textbox(initial["trainer_image"], label="Trainer image")
                i["replica_image"] = gr.Textbox(initial["replica_image"], label="Replica image")
                i["startup_timeout"] = gr.Textbox(
                    initial["startup_timeout"],
                    label="Start-up limit",
                    info="from a replica's start to healthy; empty: 15m on HF Jobs, 5m here",
                )
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
        assert set(self.inputs) == set(KEYS), set(KEYS) ^ set(self.inputs)
        self._wire()

    # --- wiring -------------------------------------------------------------------------------------------------

    def _form_inputs(self) -> set:
        return set(self.inputs.values())

    def _form(self, values: dict) -> dict[str, Any]:
        return {key: values[component] for key, component in self.inputs.items()}

    def _slot_outputs(self) -> list[gr.HTML]:
        return [self.slots[name] for name in SLOTS]

    def _wire(self) -> None:
        i = self.inputs
        form_outputs = [i[key] for key in KEYS]
        self.preset.change(
            self.apply_preset,
            [self.preset],
            [
                *form_outputs,
                *self._slot_outputs(),
                self.launch_button,
                self.status,
                self.code_group,
                self.remote_row,
                self.keys_row,
                self.cost,
                self.trials,
                self.preview,
            ],
        )
        i["bucket_kind"].input(
            self.on_bucket_kind,
            [i["bucket_kind"], i["storage_uri"]],
            [i["storage_uri"], i["storage_endpoint"], i["storage_region"], self.remote_row, self.keys_row],
        )
        i["builtin_rewards"].change(
            lambda names: [gr.update(visible=n in (names or [])) for n in ("format", "length", "regex")],
            [i["builtin_rewards"]],
            [i["format_tags"], i["length_target"], i["regex_pattern"]],
        )
        i["code_enabled"].change(lambda on: gr.Group(visible=on), [i["code_enabled"]], [self.code_group])
        i["backend"].change(
            lambda backend: [gr.update(visible=backend == "hf_jobs")] * 4,
            [i["backend"]],
            [i["namespace"], i["trainer_flavor"], i["replica_flavor"], i["queue_timeout"]],
        )
        cost_inputs = [
            i[k] for k in ("backend", "hf_credential", "trainer_flavor", "replica_flavor", "replicas", "timeout")
        ]
        for component in cost_inputs:
            component.change(
                self.estimate_cost,
                {*cost_inputs},
                [self.cost, i["trainer_flavor"], i["replica_flavor"]],
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

    def _check_outputs(self) -> list:
        return [
            *self._slot_outputs(),
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

    def load_outputs(self) -> list:
        """What refreshes when the page is opened: the credential dropdowns (they may have changed elsewhere)."""
        return [self.inputs["store_credential"], self.inputs["hf_credential"]]

    def on_open(self, store_value: str, hf_value: str, profile: gr.OAuthProfile | None) -> list:
        services = self.panel.services_or_none(profile)
        store = credential_choices(services, "s3", "no keys")
        token = credential_choices(services, "hf_token", "no token")
        return [
            gr.Dropdown(choices=store, value=store_value if store_value in {v for _, v in store} else NONE),
            gr.Dropdown(choices=token, value=hf_value if hf_value in {v for _, v in token} else _default(token)),
        ]

    # --- handlers -----------------------------------------------------------------------------------------------

    def _preset_spec(self, preset: str, owner: str | None) -> dict[str, Any]:
        if preset == "math":
            namespace = owner if owner and owner != "local" else "your-namespace"
            return presets.math_recipe(new_run_id("math"), namespace, "grpo-runs")
        return presets.demo(new_run_id("demo"), f"file://{self.panel.ctx.folder / 'store'}")

    def apply_preset(self, preset: str, profile: gr.OAuthProfile | None = None) -> list:
        form = form_from_spec(self._preset_spec(preset, self.panel.owner(profile)))
        kind = form["bucket_kind"]
        remote = kind != "local"
        hint = BUCKET_HINTS[kind]
        values = []
        for key in KEYS:
            if key == "storage_uri":
                values.append(gr.update(value=form[key], placeholder=hint[0]))
            elif key == "storage_endpoint":
                values.append(gr.update(value=form[key], placeholder=hint[1], interactive=kind in ("r2", "minio")))
            elif key == "storage_region":
                values.append(
                    gr.update(value=form[key], placeholder=hint[2], interactive=kind in ("aws", "r2", "minio"))
                )
            elif key in ("namespace", "trainer_flavor", "replica_flavor", "queue_timeout"):
                values.append(gr.update(value=form[key], visible=form["backend"] == "hf_jobs"))
            elif key in ("format_tags", "length_target", "regex_pattern"):
                values.append(gr.update(value=form[key], visible=key.split("_")[0] in form["builtin_rewards"]))
            elif key in ("store_credential", "hf_credential"):
                values.append(gr.update())
            else:
                values.append(form[key])
        return [
            *values,
            *[_errors([])] * len(SLOTS),
            gr.Button(interactive=False),
            cards.note("Preset loaded. Press Check settings: Launch is enabled once every check passes."),
            gr.Group(visible=form["code_enabled"]),
            gr.Row(visible=remote),
            gr.Row(visible=remote),
            self._cost_html(form, None),
            gr.Dataframe(visible=False),
            preview_table([]),
        ]

    @staticmethod
    def on_bucket_kind(kind: str, uri: str) -> list:
        uri_hint, endpoint_hint, region_hint = BUCKET_HINTS[kind]
        scheme = {"local": "file://", "hf": "hf://"}.get(kind, "s3://")
        remote = kind != "local"
        return [
            gr.update(placeholder=uri_hint, value=uri if uri.startswith(scheme) else ""),
            gr.update(placeholder=endpoint_hint, interactive=kind in ("r2", "minio")),
            gr.update(placeholder=region_hint, interactive=kind in ("aws", "r2", "minio")),
            gr.Row(visible=remote),
            gr.Row(visible=remote),
        ]

    @staticmethod
    def mark_changed(checked: str) -> list:
        if not checked:
            return [gr.Button(interactive=False), gr.update(), gr.update()]
        return [
            gr.Button(interactive=False),
            cards.note("Settings changed since the last check: press Check settings again.", "warn"),
            gr.Accordion(visible=False),  # the plan shown was that of the settings checked
        ]

    def _prices(self, values: dict[str, Any], services: PanelServices | None) -> tuple[dict[str, float] | None, str]:
        credential = values.get("hf_credential")
        if values.get("backend") != "hf_jobs":
            return None, ""
        if not credential or services is None:
            return None, "Select an HF token to see the Hub's live prices."
        try:
            return services.flavor_prices(int(credential)), ""
        except Exception as error:  # the Hub is unreachable or refuses the token: say so, keep the form usable
            return None, f"Could not read prices from the Hub: {error}"

    def _cost_html(self, form: dict[str, Any], prices: dict[str, float] | None, problem: str = "") -> str:
        if form.get("backend") != "hf_jobs":
            return cards.cost_line("$0.00/h", "— runs on this machine's CPU")
        if prices is None:
            return cards.cost_line("$—/h", problem)
        trainer, replica = form.get("trainer_flavor"), form.get("replica_flavor")
        count = int(form.get("replicas") or 1)
        if trainer not in prices or replica not in prices:
            unknown = trainer if trainer not in prices else replica
            return cards.cost_line("$—/h", f"the Hub has no flavor {unknown!r}")
        total = prices[trainer] + count * prices[replica]
        try:
            cap = f" · at most {money(total * timeout_seconds(form.get('timeout') or '4h') / 3600)} for the timeout"
        except ValueError:
            cap = ""
        return cards.cost_line(
            money(total, per_hour=True),
            f"trainer {trainer} {money(prices[trainer], per_hour=True)} + {count} × {replica} "
            f"{money(prices[replica], per_hour=True)}{cap}",
        )

    def estimate_cost(self, values: dict, profile: gr.OAuthProfile | None = None) -> list:
        form = {
            key: values[self.inputs[key]]
            for key in ("backend", "hf_credential", "trainer_flavor", "replica_flavor", "replicas", "timeout")
        }
        prices, problem = self._prices(form, self.panel.services_or_none(profile))
        flavors = sorted(prices) if prices else COMMON_FLAVORS
        return [
            self._cost_html(form, prices, problem),
            gr.Dropdown(choices=flavors),
            gr.Dropdown(choices=flavors),
        ]

    def check(self, values: dict, profile: gr.OAuthProfile | None = None) -> list:
        """Run the backend's preflight on the form; enable Launch only if it passes."""
        services = self.panel.services(profile)
        form = self._form(values)
        built = spec_from_form(form)
        store_credential, hf_credential = credentials(form)
        try:
            result = services.preflight(built.spec, store_credential, hf_credential)
        except LimitReached as error:
            raise gr.Error(str(error)) from None
        routed = route_errors(result.errors, built, bool(form["code_enabled"]))
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
        if result.ok:
            warnings = "; ".join(result.warnings)
            status = cards.note(
                "All checks passed: bucket, dataset, rewards and compute. Launch is enabled."
                + (f" Note: {warnings}" if warnings else ""),
                "good",
            )
        else:
            status = cards.note(
                f"{len(result.errors)} problem{'s' if len(result.errors) != 1 else ''} to fix (shown next to each "
                "field). Launch stays disabled until Check settings passes.",
                "bad",
            )
        return [
            *[_errors(routed[slot]) for slot in SLOTS],
            preview_table(rows),
            trials,
            cost,
            gr.Button(interactive=result.ok),
            status,
            gr.Accordion(open=True) if open_advanced else gr.update(),
            _fingerprint(form) if result.ok else "",
            rows,
            gr.Accordion(visible=result.plan is not None),
            cards.json_block(result.plan) if result.plan is not None else "",
        ]

    def _cost_total(self, form: dict[str, Any], result) -> str:
        if form.get("backend") != "hf_jobs":
            return self._cost_html(form, None)
        return cards.cost_line(money(result.cost_per_hour, per_hour=True), "at the Hub's current prices")

    def test_rewards(self, values: dict, profile: gr.OAuthProfile | None = None) -> list:
        """Score sample rows with the rewards on screen, in the sandbox; each error goes next to its reward."""
        services = self.panel.services(profile)
        form = self._form(values)
        code_enabled = bool(form["code_enabled"])
        rewards, reward_slots = rewards_of(form)
        errors: dict[str, list[str]] = {"rewards_builtin": [], "rewards_code": []}
        specs = []
        for index, reward in enumerate(rewards):
            try:
                specs.append(RewardSpec.model_validate(reward))
            except ValidationError as error:
                message = "; ".join(e["msg"].removeprefix("Value error, ") for e in error.errors())
                errors[reward_slots[index]].append(f"{reward['name']}: {message}")
        if not rewards:
            errors["rewards_builtin"].append("Pick at least one built-in reward or add one written in Python.")
        rows = values[self.rows]
        preview = gr.update()
        if not rows and specs and not any(errors.values()):
            store_credential, hf_credential = credentials(form)
            result = services.preflight(spec_from_form(form).spec, store_credential, hf_credential)
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
                for index, trial in enumerate(trials):
                    if trial.error:
                        where = f" (row {trial.row + 1})" if trial.row is not None else ""
                        slot = slot_of(f"rewards.{index}", reward_slots, code_enabled)
                        errors[slot].append(f"{trial.name}{where}: {trial.error}")
        return [
            table,
            _errors(errors["rewards_builtin"]),
            _errors(errors["rewards_code"]),
            rows,
            preview,
        ]

    def test_connection(self, values: dict, profile: gr.OAuthProfile | None = None) -> list:
        """Save typed keys to the vault (never echoed back), then probe the bucket with them."""
        services = self.panel.services(profile)
        form = self._form(values)
        access_key, secret_key = (values[self.access_key] or "").strip(), (values[self.secret_key] or "").strip()
        credential_id = credentials(form)[0]
        kind = form["bucket_kind"]
        if kind != "local" and access_key and secret_key:
            name = f"{BUCKET_KINDS[kind]} · {_bucket_name(form['storage_uri'])}"
            credential = services.credentials.save(
                services.owner, name, "s3", {"access_key_id": access_key, "secret_access_key": secret_key}
            )
            credential_id = credential.id
        elif kind != "local" and (access_key or secret_key):
            return [
                _errors(["Bucket keys: enter both the access key id and the secret."]),
                gr.update(),
                "",
                "",
            ]
        built = spec_from_form(form).spec["storage"]
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
        return [result, gr.Dropdown(choices=choices, value=value), "", ""]

    def smoke_test(self, values: dict, profile: gr.OAuthProfile | None = None) -> str:
        """Run the smoke test on the settings that passed the check (it submits a job: no unchecked settings)."""
        services = self.panel.services(profile)
        form = self._form(values)
        checked = values[self.checked]
        if form.get("backend") != "hf_jobs":
            return cards.note("The smoke test runs on Hugging Face Jobs; choose it under Compute first.", "warn")
        if not checked or checked != _fingerprint(form):
            return cards.note("Press Check settings first: the smoke test runs the settings that passed it.", "warn")
        store_credential, hf_credential = credentials(form)
        spec = RunSpec.model_validate(json.loads(checked)["spec"])
        try:
            report = services.smoke_test(spec, store_credential, hf_credential)
        except (ValueError, LimitReached) as error:  # a credential not this owner's, no bucket keys, too many at once
            return cards.note(f"Smoke test not started: {error}", "bad")
        return cards.smoke_report(report)

    def launch(self, values: dict, profile: gr.OAuthProfile | None = None) -> tuple[str | None, list]:
        """Create and start the run whose settings passed the check; returns its id (None if nothing launched)."""
        services = self.panel.services(profile)
        form = self._form(values)
        checked = values[self.checked]
        if not checked or checked != _fingerprint(form):
            return None, [
                gr.Button(interactive=False),
                cards.note("Settings changed since the last check: press Check settings again.", "warn"),
            ]
        store_credential, hf_credential = credentials(form)
        try:
            spec = RunSpec.model_validate(json.loads(checked)["spec"])
            run = services.runs.create(spec, store_credential, hf_credential)
            services.runs.launch(run.id)
        except Exception as error:  # run id taken since the check, bucket gone, ...
            return None, [gr.Button(interactive=False), cards.note(f"Not launched: {error}", "bad")]
        return run.id, [
            gr.Button(interactive=False),
            cards.note(f"Launched {run.id}: its jobs are starting. Opening the monitor…", "good"),
        ]

    def wire_launch(self, navigate, outputs: list) -> None:
        """Launch, then open the new run: `navigate(run_id, profile)` gives the updates for `outputs`."""

        def launch_and_open(values: dict, profile: gr.OAuthProfile | None = None) -> list:
            run_id, updates = self.launch(values, profile)
            follow = navigate(run_id, profile) if run_id else [gr.update()] * len(outputs)
            fresh = gr.update(value=new_run_id(run_id.split("-")[0])) if run_id else gr.update()
            return [*updates, "" if run_id else gr.update(), fresh, *follow]

        self.launch_button.click(
            launch_and_open,
            {*self._form_inputs(), self.checked},
            [self.launch_button, self.status, self.checked, self.inputs["run_id"], *outputs],
        )


def _fingerprint(form: dict[str, Any]) -> str:
    """What a passing check vouches for: the validated spec and the credentials chosen with it."""
    try:
        spec = json.loads(parse_spec(spec_from_form(form).spec).to_json())
    except SpecError:
        return ""
    return json.dumps({"spec": spec, "credentials": list(credentials(form))}, sort_keys=True)


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
