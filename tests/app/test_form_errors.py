"""Every error key the product can produce lands in the note of its field on the launch form, labelled in words.

The keys are not typed in here: they are what the product answers. Every field of RunSpec, walked from the model (so
a new field fails this test until the table below says where its errors go), is given a value it refuses and then a
secret, and whatever keys `parse_spec` names are routed; so are the keys of the spec's cross-field checks and the
keys preflight names itself, collected from the modules that raise them. The form is the launch form with one
built-in reward (`rewards.0`) and one reward written in Python (`rewards.1`).
"""

from __future__ import annotations

import copy
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any

import gradio as gr
import pytest
from pydantic import BaseModel, Field, ValidationError

from app.launch_form import (
    CODE_TEMPLATE,
    KEYS,
    SLOTS,
    FormSchema,
    form_from_spec,
    label,
    route_errors,
    slot_of,
    spec_from_form,
)
from app.pages.launch import LaunchPage
from app.panel import Panel
from backend.context import PanelContext
from backend.database.connection import Database
from jobs.contract import GrpoSpec, RunSpec, SpecError, parse_spec
from jobs.contract.spec import shown
from jobs.demo.preset import demo_spec

REPO = Path(__file__).resolve().parents[2]
MESSAGE = "what is wrong and how to fix it"
SECRET = "hf_abcdefghijklmnopqrstuvwxyz0123"  # token-shaped: the spec's secret check refuses it wherever it is
INVALID = [{"not": "valid"}]  # refused by every field: no string, number, bool, literal, dict or list of strings
REWARD = "reward"  # in the table: the note of the reward the key names (rewards.0 built-in, rewards.1 code)
METRIC = "metric"  # the note of the eval metric the key names (eval.metrics.0 built-in, eval.metrics.1 code)
# Where the errors of each RunSpec field (and of each key preflight names on its own) must show, and their label.
# `rewards.*.<field>` is a field of any reward; its label reads "<label> of reward <n> (<name>)"; an eval metric's,
# "<label> of eval metric <n> (<name>)".
EXPECTED: dict[str, tuple[str, str | None]] = {
    "spec": ("general", "Settings"),
    "schema_version": ("general", "Spec version"),
    "run_id": ("run", "Run id"),
    "name": ("run", "Name"),
    "model.id": ("model", "Model"),
    "model.revision": ("advanced", "Revision"),
    "model.max_model_len": ("advanced", "Max model length"),
    "model.dtype": ("advanced", "Dtype"),
    "dataset": ("dataset", "Dataset"),
    "dataset.source": ("dataset", "Dataset source"),
    "dataset.id": ("dataset", "Dataset"),
    "dataset.split": ("dataset", "Split"),
    "dataset.prompt_column": ("dataset", "Prompt column"),
    "dataset.answer_column": ("dataset", "Answer column"),
    "dataset.system_prompt": ("dataset", "System prompt"),
    "dataset.limit": ("dataset", "Row limit"),
    "eval.split": ("dataset", "Held-out split"),
    "eval.holdout": ("dataset", "Held-out rows"),
    "eval.prompts": ("advanced", "Eval prompts"),
    "eval.k": ("advanced", "Eval samples per prompt"),
    "eval.greedy": ("advanced", "Greedy eval"),
    "eval.seed": ("advanced", "Eval seed"),
    "eval.during_run": ("advanced", "Evaluate during the run"),
    "eval.every": ("advanced", "Eval every N versions"),
    "eval.patience": ("advanced", "Eval patience"),
    "eval.stop_on_regression": ("advanced", "Stop when held-out stalls"),
    "eval.metrics": ("rewards_code", "Eval metrics"),  # the list as a whole: beside the rewards, whose code it uses
    "eval.metrics.*": (METRIC, None),  # a metric's trial: its message starts with the metric's name
    "eval.metrics.*.kind": (METRIC, "Kind"),
    "eval.metrics.*.name": (METRIC, "Name"),
    "eval.metrics.*.params": (METRIC, "Parameters"),
    "eval.metrics.*.source": (METRIC, "Code"),
    "eval.metrics.*.entry_point": (METRIC, "Function to call"),
    "eval.metrics.*.weight": (METRIC, "Weight"),
    "rewards": ("rewards_code", "Rewards"),  # the list as a whole; the form has a code reward
    "rewards.*": (REWARD, None),  # a reward's trial: its message starts with the reward's name, no label
    "rewards.*.kind": (REWARD, "Kind"),
    "rewards.*.name": (REWARD, "Name"),
    "rewards.*.params": (REWARD, "Parameters"),
    "rewards.*.source": (REWARD, "Code"),
    "rewards.*.entry_point": (REWARD, "Function to call"),
    "rewards.*.weight": (REWARD, "Weight"),
    "environment": ("training", "Tools"),
    "environment.kind": ("training", "Tools"),
    "environment.name": ("advanced", "Environment"),
    "environment.source": ("training", "Environment code"),
    "environment.entry_point": ("training", "Environment class or tools"),
    "environment.max_turns": ("training", "Max tool turns"),
    "environment.max_episode_tokens": ("advanced", "Episode token budget"),
    "environment.packages": ("advanced", "Environment packages"),
    "lora.rank": ("training", "LoRA rank"),
    "lora.alpha": ("training", "LoRA alpha"),
    "lora.target_modules": ("training", "Target modules"),
    "lora.dropout": ("advanced", "LoRA dropout"),
    "grpo.num_generations": ("training", "Generations per prompt"),
    "grpo.completions_per_step": ("training", "Completions per step"),
    "grpo.max_completion_length": ("training", "Max completion tokens"),
    "grpo.temperature": ("advanced", "Temperature"),
    "grpo.top_p": ("advanced", "Top-p"),
    "grpo.top_k": ("advanced", "Top-k"),
    "grpo.learning_rate": ("training", "Learning rate"),
    "grpo.adam_beta2": ("advanced", "Adam β2"),
    "grpo.epsilon": ("advanced", "Clip ε"),
    "grpo.max_steps": ("training", "Max steps"),
    "grpo.max_staleness": ("training", "Max staleness"),
    "grpo.weight_sync_steps": ("advanced", "Weight sync every"),
    "grpo.max_inflight": ("advanced", "Max in flight"),
    "grpo.queue_size": ("advanced", "Queue size"),
    "grpo.token_budget": ("advanced", "Token budget"),
    "grpo.gradient_checkpointing": ("advanced", "Gradient checkpointing"),
    "grpo.save_steps": ("advanced", "Checkpoint every"),
    "grpo.seed": ("advanced", "Seed"),
    "grpo.audit_every": ("advanced", "Policy audit every"),
    "compute.backend": ("compute", "Where the jobs run"),
    "compute.token": ("compute", "HF token"),
    "compute.namespace": ("compute", "Namespace"),
    "compute.trainer_flavor": ("compute", "Trainer hardware"),
    "compute.replica_flavor": ("compute", "Replica hardware"),
    "compute.replicas": ("compute", "Replicas"),
    "compute.timeout": ("compute", "Timeout"),
    "compute.queue_timeout": ("compute", "Queue limit"),
    "compute.startup_timeout": ("advanced", "Start-up limit"),
    "compute.replica_image": ("advanced", "Replica image"),
    "compute.trainer_image": ("advanced", "Trainer image"),
    "compute.engine": ("advanced", "Inference engine"),
    "compute.cost_cap_usd": ("advanced", "Cost cap"),
    "compute.trainer_processes": ("advanced", "Trainer processes"),
    "compute.trainer_sharding": ("advanced", "Trainer sharding"),
    "storage.uri": ("storage", "Bucket location"),
    "storage.endpoint": ("storage", "Endpoint"),
    "storage.region": ("storage", "Region"),
    "storage.credentials": ("storage", "Bucket keys"),
    "reporting.trackio": ("reporting", "Trackio"),
    "reporting.trackio_space": ("reporting", "Trackio Space"),
    "reporting.wandb": ("reporting", "Weights & Biases"),
    "reporting.project": ("reporting", "Project"),
    "reporting.wandb_entity": ("advanced", "W&B entity"),
    "reporting.wandb_key": ("reporting", "W&B key"),
    "parent.run_id": ("general", "Parent run id"),
    "parent.version": ("general", "Parent version"),
}
# Keys preflight names itself, gathered from the code that raises them: `errors["..."]` in preflight, and the
# "<field>: ..." messages of the errors it turns into keys. A templated one expands to the keys it stands for.
PREFLIGHT_SOURCES = {
    "backend/launch/preflight.py": r'errors\[f?"([^"]+)"\]',
    "jobs/trainer/dataset.py": r'DatasetError\(\s*f?"([a-z_][\w.{}]*): ',
    # LaunchError and its kinds (UnknownFlavor, ...); preflight keys only the compute.* ones by their field.
    "backend/launchers/hf_jobs.py": r'raise \w+\(\s*f?"(compute\.[\w.{}]*): ',
    "backend/launchers/base.py": r'raise \w+\(\s*f?"(compute\.[\w.{}]*): ',
    "backend/services/runs.py": r'RunStateError\(\s*f?"([a-z_][\w.{}]*): ',
    # The field of each reward and eval metric a trial names (preflight keys its failures so).
    "jobs/evaluation/results.py": r'f"((?:rewards|eval\.metrics)\.\{i\})"',
}
TEMPLATES = {
    "rewards.{index}": ["rewards.0", "rewards.1"],
    "rewards.{i}": ["rewards.0", "rewards.1"],
    "eval.metrics.{i}": ["eval.metrics.0", "eval.metrics.1"],
    "compute.{field}": ["compute.trainer_flavor", "compute.replica_flavor"],
    "dataset.{field}": ["dataset.prompt_column", "dataset.answer_column"],
    "reporting.{name}": ["reporting.trackio", "reporting.wandb"],
}


@pytest.fixture(scope="module")
def form() -> dict[str, Any]:
    """The launch form filled with the demo, one built-in reward and one written in Python, and likewise two eval
    metrics (a built-in, and a further function of the reward code)."""
    values = form_from_spec(demo_spec("form-errors", "file:///tmp/form-errors-store").model_dump())
    values.update(
        builtin_rewards=["digit_frac"], code_enabled=True, code_name="custom", code_entry="reward", code_weight=1.0
    )
    values.update(builtin_metrics=["length"], code_metrics="exact", code_source=CODE_TEMPLATE + EXACT)
    values.update(store_credential="", hf_credential="", wandb_credential="")
    built = spec_from_form(values)
    assert [r["kind"] for r in built.spec["rewards"]] == ["builtin", "code"]
    assert built.reward_slots == ["rewards_builtin", "rewards_code"]
    assert [(m["kind"], m["name"]) for m in built.spec["eval"]["metrics"]] == [("builtin", "length"), ("code", "exact")]
    assert built.metric_slots == ["rewards_builtin", "rewards_code"]
    parse_spec(built.spec)  # valid as built: every error below comes from the one value changed
    return values


EXACT = "\n\ndef exact(completions, answer, **columns):\n    return [1.0] * len(completions)\n"


# --- the keys the product produces ------------------------------------------------------------------------------


def _model_in(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The pydantic model a field holds (directly, optionally or as a list of them), and whether it is a list."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _model_in(args[0])
    if origin is list and args:
        model, _ = _model_in(args[0])
        return model, model is not None
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            model, is_list = _model_in(arg)
            if model is not None:
                return model, is_list
    return None, False


def spec_fields(model: type[BaseModel] = RunSpec, prefix: str = "") -> list[str]:
    """Every leaf field of the spec as a dotted path; the items of a list of sections as `*`."""
    paths = []
    for name, info in model.model_fields.items():
        inner, is_list = _model_in(info.annotation)
        path = f"{prefix}{name}"
        if inner is None:
            paths.append(path)
        else:
            paths += spec_fields(inner, f"{path}.*." if is_list else f"{path}.")
    return paths


def _set(data: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A deep copy of `data` with `path` (dotted, list items by number) set to `value`."""
    data = copy.deepcopy(data)
    *parents, last = path.split(".")
    node: Any = data
    for part in parents:
        if isinstance(node, list):
            node = node[int(part)]
        else:
            if node.get(part) is None:  # an optional section the form leaves out (a branch's parent)
                node[part] = {"run_id": "another-run", "version": 1} if part == "parent" else {}
            node = node[part]
    node[last] = value
    return data


def _errors(data: Any) -> dict[str, str]:
    try:
        parse_spec(data)
    except SpecError as error:
        return error.errors
    raise AssertionError(f"the spec was accepted: {data}")


def produced_keys(spec: dict[str, Any]) -> list[tuple[str, str]]:
    """(generic field path, key the product named) for every way the spec gets an error in."""
    found: list[tuple[str, str]] = []
    for field in spec_fields():
        concrete = [field.replace("*", str(index)) for index in (0, 1)] if "*" in field else [field]
        for path in concrete:
            for value in (INVALID, SECRET, [SECRET], {"tags": [SECRET]}):
                errors = _errors(_set(spec, path, value))
                found += [(field, key) for key in errors]
    # The cross-field checks, and a spec that is not even an object.
    cross = [
        ({**spec, "rewards": []}, "rewards"),
        ({**spec, "rewards": [spec["rewards"][1], spec["rewards"][1]]}, "rewards"),
        (_set(spec, "eval.metrics", [spec["eval"]["metrics"][1]] * 2), "eval.metrics"),
        (_set(spec, "grpo.max_completion_length", 10_000), "grpo.max_completion_length"),
        (_set(spec, "parent.run_id", spec["run_id"]), "parent.run_id"),
        (_set(spec, "grpo.queue_size", 2), "grpo.queue_size"),
        (_set(spec, "compute.backend", "hf_jobs"), "compute.namespace"),
        (_set(spec, "storage.uri", "s3://"), "storage.uri"),
    ]
    for data, field in cross:
        assert field in _errors(data), (field, _errors(data))
        found.append((field, field))
    assert set(_errors(["not", "a", "spec"])) == {"spec"}
    found.append(("spec", "spec"))
    return found


def preflight_keys() -> list[str]:
    keys: list[str] = []
    for path, pattern in PREFLIGHT_SOURCES.items():
        for key in re.findall(pattern, (REPO / path).read_text()):
            if "{" in key:
                assert key in TEMPLATES, f"{path} names errors {key!r}: say in TEMPLATES which keys that stands for"
                keys += TEMPLATES[key]
            else:
                keys.append(key)
    return keys


def generic(key: str) -> str:
    """The table entry a preflight key belongs to: `rewards.1` -> `rewards.*`, `eval.metrics.0` -> `eval.metrics.*`."""
    return re.sub(r"^(rewards|eval\.metrics)\.\d+", r"\1.*", key)


FUNCTION = re.compile(r"^(rewards|eval\.metrics)(?:\.|\[)(\d+)")  # a key about one reward or eval metric


def function_of(key: str) -> tuple[str, int]:
    """Which list (`rewards`, `eval.metrics`) and which entry of it a key names."""
    match = FUNCTION.match(key)
    assert match, key
    return match.group(1), int(match.group(2))


# --- the checks ---------------------------------------------------------------------------------------------------


def expected_slot(field: str, key: str, built) -> str:
    slot, _ = EXPECTED[field]
    if slot not in (REWARD, METRIC):
        return slot
    _, index = function_of(key)
    return (built.reward_slots if slot == REWARD else built.metric_slots)[index]


def routed_one(key: str, built, code_enabled: bool = True) -> tuple[str, str]:
    """(slot, text) of the one note an error on `key` shows in."""
    routed = route_errors({key: MESSAGE}, built, code_enabled)
    shown = [(slot, text) for slot, texts in routed.items() for text in texts]
    assert set(routed) == set(SLOTS) and len(shown) == 1, (key, routed)
    return shown[0]


def check_label(field: str, key: str, text: str, spec: dict[str, Any]) -> None:
    _, expected = EXPECTED[field]
    if expected is None:  # a reward's own message: shown as it is
        assert text == MESSAGE, (key, text)
        return
    assert text.endswith(f": {MESSAGE}"), (key, text)
    shown = text.removesuffix(f": {MESSAGE}")
    if field.startswith(("rewards.*.", "eval.metrics.*.")):
        kind, index = function_of(key)
        items, word = (spec["rewards"], "reward") if kind == "rewards" else (spec["eval"]["metrics"], "eval metric")
        expected = f"{expected} of {word} {index + 1} ({items[index]['name']})"
    assert shown == expected, (key, shown)
    # Words, never the raw key: no dotted path, no list index, no field name with underscores.
    assert key not in shown and not re.search(r"\w\.\w|\[\d*\]", shown), (key, shown)
    assert not [part for part in re.split(r"[.\[\]]", key) if "_" in part and part in shown], (key, shown)


def test_every_spec_field_has_a_row_in_the_table():
    """A field added to RunSpec fails here until the table says which note shows its errors and how it is named."""
    fields = set(spec_fields())
    assert fields - set(EXPECTED) == set(), "RunSpec fields with no slot and label in EXPECTED"
    assert {"rewards.*.source", "parent.run_id", "grpo.max_staleness", "compute.cost_cap_usd"} <= fields


def test_every_key_the_spec_produces_lands_in_its_fields_note_with_a_human_label(form):
    built = spec_from_form(form)
    cases = produced_keys(built.spec)
    keys = {key for _, key in cases}
    # The two spellings the product uses for one field are both among them.
    assert {"rewards.1.source", "rewards[1].source", "lora.target_modules[0]", "rewards[0].params.tags[0]"} <= keys
    seen_slots = set()
    for field, key in cases:
        slot, text = routed_one(key, built)
        assert slot == expected_slot(field, key, built), (field, key, slot)
        check_label(field, key, text, built.spec)
        seen_slots.add(slot)
    assert seen_slots == set(SLOTS)


def test_every_key_preflight_names_lands_in_its_fields_note_with_a_human_label(form):
    built = spec_from_form(form)
    keys = preflight_keys()
    assert {"storage.credentials", "compute.token", "compute.engine", "model.id", "rewards", "rewards.1"} <= set(keys)
    assert {"dataset.split", "dataset.prompt_column", "compute.trainer_flavor"} <= set(keys)
    for key in keys:
        field = generic(key)
        assert field in EXPECTED, f"preflight names {key!r}: add it to EXPECTED"
        slot, text = routed_one(key, built)
        assert slot == expected_slot(field, key, built), (key, slot)
        check_label(field, key, text, built.spec)


def test_all_eleven_notes_are_reached(form):
    """Each of the form's notes shows some error: the table exercises every one of them."""
    built = spec_from_form(form)
    keys = [key for _, key in produced_keys(built.spec)] + preflight_keys()
    reached = {routed_one(key, built)[0] for key in keys}
    assert reached == set(SLOTS) and len(SLOTS) == 11


def test_without_a_code_reward_reward_errors_go_to_the_builtin_note(form):
    built = spec_from_form({**form, "code_enabled": False})
    assert built.reward_slots == ["rewards_builtin"]
    for key in ("rewards", "rewards.0", "rewards.0.params", "rewards[0].name"):
        assert routed_one(key, built, code_enabled=False)[0] == "rewards_builtin", key


def test_a_misspelt_field_is_named_in_words_in_its_sections_note(form):
    built = spec_from_form(form)
    errors = _errors({**built.spec, "grpo": {**built.spec["grpo"], "max_stalenes": 4}})
    assert set(errors) == {"grpo.max_stalenes"}
    assert routed_one("grpo.max_stalenes", built) == ("training", f"Training: max stalenes: {MESSAGE}")
    assert label("compute.gpu", None) == "Compute: gpu"


# Keys that name more than the form holds: a reward past the last one or with no name, a field nobody labelled, a
# bare reward (route_errors shows a reward's own message as it is, so only a direct call labels `rewards.<n>`).
NAMED = [{"kind": "builtin", "name": "digit_frac"}, {"kind": "code", "name": "custom"}]
UNNAMED = [{"kind": "builtin", "name": "digit_frac"}, {"kind": "code", "name": ""}]
ODD_LABELS = [  # (key, the spec's rewards, label)
    ("rewards.1", NAMED, "Reward 2 (custom)"),
    ("rewards[1]", [{"kind": "code"}, {"kind": "code"}], "Reward 2"),
    ("rewards[1].source", UNNAMED, "Code of reward 2"),
    ("rewards.0.bogus_field", NAMED, "Bogus field of reward 1 (digit_frac)"),
    ("rewards.2.source", NAMED, "Code of reward 3"),  # one past the last reward
    ("rewards.5.weight", NAMED, "Weight of reward 6"),
    ("rewards.0.weight", None, "Weight of reward 1"),  # no spec to take the name from
    ("eval.metrics[1].source", NAMED, "Code of eval metric 2"),  # the rewards' names are not the metrics'
    ("bogus", None, "Settings: bogus"),
    ("grpo.not_a_field.deeper", NAMED, "Training: not a field deeper"),
]


@pytest.mark.parametrize(("key", "rewards", "expected"), ODD_LABELS)
def test_a_key_the_form_has_no_field_for_is_still_labelled_in_words(key, rewards, expected):
    assert label(key, rewards) == expected


@pytest.mark.parametrize(
    ("key", "reward_slots", "code_enabled", "slot"),
    [
        ("rewards.2.source", ["rewards_builtin", "rewards_code"], True, "rewards_code"),  # one past the last slot
        ("rewards[1]", ["rewards_builtin"], False, "rewards_builtin"),
        ("rewards.0.weight", [], True, "rewards_code"),
        ("eval.metrics.3.name", ["rewards_builtin"], False, "rewards_builtin"),  # metrics sit beside the rewards
    ],
)
def test_a_reward_past_the_forms_last_goes_to_the_rewards_note_of_the_mode(key, reward_slots, code_enabled, slot):
    assert slot_of(key, reward_slots, code_enabled) == slot


def test_a_reward_past_the_forms_last_is_routed_with_its_number(form):
    built = spec_from_form(form)
    assert routed_one("rewards.2.source", built) == ("rewards_code", f"Code of reward 3: {MESSAGE}")


@pytest.mark.parametrize("code_enabled", [True, False])
def test_errors_are_routed_without_a_built_form(code_enabled):
    errors = {"rewards[1].source": MESSAGE, "rewards.0": MESSAGE, "grpo.max_staleness": MESSAGE}
    rewards_slot = "rewards_code" if code_enabled else "rewards_builtin"
    assert route_errors(errors, None, code_enabled) == {slot: [] for slot in SLOTS} | {
        rewards_slot: [f"Code of reward 2: {MESSAGE}", MESSAGE],
        "training": [f"Max staleness: {MESSAGE}"],
    }


def test_a_secret_in_reward_code_is_shown_under_the_code_editor(tmp_path, form):
    """The reported case, through the page's own Check: `rewards[1].source` under the editor, the general note empty."""
    panel = Panel(PanelContext(Database(tmp_path / "panel.sqlite3"), tmp_path / "panel"), space=False)
    page = LaunchPage(panel)
    with gr.Blocks():
        page.build()
    source = f'TOKEN = "{SECRET}"\n' + CODE_TEMPLATE
    reported = {**form, "code_source": source, "code_metrics": ""}  # the reported form had no code metric
    values = {page.inputs[key]: value for key, value in reported.items() if key in KEYS}
    outputs = page.check(values)
    assert set(outputs) == set(page._check_outputs())
    notes = {slot: outputs[page.slots[slot]] for slot in SLOTS}
    code_note = notes["rewards_code"]
    assert code_note.visible and "Code of reward 2 (custom): holds what looks like" in code_note.value
    assert "rewards[1]" not in code_note.value and SECRET not in code_note.value
    assert [slot for slot, note in notes.items() if note.visible] == ["rewards_code"]
    assert outputs[page.launch_button].interactive is False
    panel.ctx.db.close()


# --- the form is generated from the spec ----------------------------------------------------------------------------


def _ancestors(component: Any) -> list[Any]:
    chain, node = [], getattr(component, "parent", None)
    while node is not None:
        chain.append(node)
        node = getattr(node, "parent", None)
    return chain


@pytest.mark.parametrize(
    ("section", "advanced", "slot"),
    [("training", False, "training"), ("compute", True, "advanced")],
)
def test_a_field_added_to_the_spec_is_on_the_form_in_its_spec_and_in_its_errors(tmp_path, section, advanced, slot):
    """One declaration in a copy of the spec model, no other edit: the Launch page shows the field in its section
    with its label, help and default, the form puts it in the spec (where it is validated), reads it back from a
    spec, and an error about it lands in its section's note under its label."""

    class WarmupGrpo(GrpoSpec):
        warmup_steps: Annotated[
            int,
            Field(ge=0, le=100),
            shown("Warm-up steps", section, "optimizer steps at a rising learning rate", advanced=advanced),
        ] = 3

    class WarmupSpec(RunSpec):
        grpo: Annotated[WarmupGrpo, shown("Training", "training")] = Field(default_factory=WarmupGrpo)

    schema = FormSchema(WarmupSpec)
    assert "grpo.warmup_steps" in schema.keys and "grpo.warmup_steps" not in FormSchema(RunSpec).keys
    panel = Panel(PanelContext(Database(tmp_path / "panel.sqlite3"), tmp_path / "panel"), space=False)
    page = LaunchPage(panel, schema)
    with gr.Blocks():
        page.build()
    widget = page.inputs["grpo.warmup_steps"]
    assert isinstance(widget, gr.Number) and widget.precision == 0
    assert (widget.label, widget.info, widget.value) == (
        "Warm-up steps",
        "optimizer steps at a rising learning rate; 0 to 100",
        3,
    )
    assert (page.advanced in _ancestors(widget)) is advanced

    form = {
        **schema.form_from_spec(demo_spec("warmup", "file:///tmp/warmup-store").model_dump()),
        "grpo.warmup_steps": 7,
    }
    built = schema.spec_from_form(form)
    assert built.spec["grpo"]["warmup_steps"] == 7
    assert WarmupSpec.model_validate(built.spec).grpo.warmup_steps == 7
    assert schema.form_from_spec(built.spec)["grpo.warmup_steps"] == 7

    refused = schema.spec_from_form({**form, "grpo.warmup_steps": 500}).spec
    with pytest.raises(ValidationError) as caught:
        WarmupSpec.model_validate(refused)
    errors = {".".join(map(str, error["loc"])): error["msg"] for error in caught.value.errors()}
    assert list(errors) == ["grpo.warmup_steps"]
    routed = schema.route_errors(errors, built, code_enabled=False)
    assert routed[slot] == [f"Warm-up steps: {errors['grpo.warmup_steps']}"]
    assert [name for name, texts in routed.items() if texts] == [slot]
    panel.ctx.db.close()


def test_every_field_of_the_form_is_labelled_as_its_errors_are():
    """The widget's label is the one the error notes use: one name per field, from the spec."""
    schema = FormSchema(RunSpec)
    for form_field in schema.fields:
        assert schema.label(form_field.path) == form_field.label, form_field.path
    assert {"compute.trainer_processes", "compute.trainer_sharding"} <= set(schema.keys)
