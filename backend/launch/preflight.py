"""Everything checked before a run is launched, so bad input costs nothing and every error names its field.

Checks, in order: the spec itself; the bucket (a probe object written, read back and deleted with the given keys);
the compute (token, namespace, flavors known to the Hub, the $/hour estimate); the model (present on the Hub or on
disk, with a chat template TRL can read replies in); the dataset (a few rows load, the prompt and answer columns
exist); the rewards (run on those rows in the sandbox). The result maps dotted field names to messages, which the
launch form shows next to each field; once every check passes it also holds the plan of what Launch would submit
(the same as `python -m backend plan` prints).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from backend.context import PanelContext
from backend.credentials.vault import CredentialError
from backend.database.models import Run
from backend.launch.images import check_images
from backend.launchers.base import LaunchError
from backend.launchers.hf_jobs import bound_hub_calls, hub_replica_engine
from backend.sandbox.client import RewardTrial, SandboxError, SandboxLimits, rehearse_environment, run_rewards
from backend.services.costs import estimate_per_hour
from backend.services.runs import RunStateError, check_hosting, run_id_taken
from jobs.chat_templates import ADDITIONAL_TEMPLATES_DIR, ChatTemplateError, chat_template_in, response_template
from jobs.contract import BUILTIN_MODELS, RunSpec, SpecError, derived, parse_spec
from jobs.contract.flavors import flavor
from jobs.evaluation.heldout import HeldOut, held_out
from jobs.evaluation.results import function_fields, scored_functions
from jobs.pins import missing
from jobs.replica.engine_command import choose_engine
from jobs.store import ObjectStore, S3Store, StoreAccessError, StoreError
from jobs.trainer.dataset import DatasetError, build_prompts, check_columns, load_rows
from jobs.trainer.reporting import missing_packages

log = logging.getLogger(__name__)
SAMPLE_ROWS = 4
# What preflight reads of a Hub model: where a tokenizer keeps its chat template (jobs/chat_templates.py reads them as
# transformers does), and the config (attention heads, for the replicas' tensor parallelism).
MODEL_FILES = {"tokenizer_config.json", "chat_template.jinja", "config.json"}
HUB_PROBE_TIMEOUT = 5.0  # seconds for the one request that tells whether the Hub is reachable
_LOCAL_JOBS_NEED_THE_HUB = (
    "local jobs share this machine's network and load it from the Hub, so the run would fail after its replicas "
    "start: check the network"
)


@dataclass
class Preflight:
    spec: RunSpec | None = None
    errors: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    # What could not be checked, each with why: shown as "not checked", never as passed.
    unchecked: dict[str, str] = field(default_factory=dict)
    preview: list[dict[str, Any]] = field(default_factory=list)
    trials: list[RewardTrial] = field(default_factory=list)
    cost_per_hour: float | None = None
    plan: dict[str, Any] | None = None  # what Launch would submit (backend/launch/plan.py), once every check passed
    parameters: int | None = None  # the model's parameter count, where the Hub said it (it decides the sharding)
    held_out: HeldOut | None = None  # the prompts versions are evaluated on, when the run evaluates

    @property
    def ok(self) -> bool:
        return self.checked_spec is not None

    @property
    def checked_spec(self) -> RunSpec | None:
        """The spec when every check passed (`ok`), else None: one test that also tells mypy the spec is there."""
        return self.spec if not self.errors else None


def run_preflight(
    ctx: PanelContext,
    owner: str,
    data: dict[str, Any] | RunSpec,
    store_credential_id: int | None = None,
    hf_credential_id: int | None = None,
    sample_rows: int = SAMPLE_ROWS,
    sandbox: SandboxLimits = SandboxLimits(),
    wandb_credential_id: int | None = None,
) -> Preflight:
    result = Preflight()
    try:
        spec = data if isinstance(data, RunSpec) else parse_spec(data)
    except SpecError as error:
        result.errors.update(error.errors)
        return result
    result.spec = spec
    if run_id_taken(ctx, spec.run_id):
        result.errors["run_id"] = (
            f"{spec.run_id!r} is taken by another run; choose another id (the Launch page proposes a free one)"
        )
    probe = Run(
        id=spec.run_id,
        owner=owner,
        spec_json=spec.to_json(),
        storage_uri=spec.storage.uri,
        backend=spec.compute.backend,
        created_at=0.0,
        store_credential_id=store_credential_id,
        hf_credential_id=hf_credential_id,
        wandb_credential_id=wandb_credential_id,
    )
    _check_reporting(ctx, owner, spec, wandb_credential_id, result)
    store = _check_store(ctx, probe, spec, result)
    hub_online = _check_hub(ctx, spec, result)
    if hub_online:
        _check_compute(ctx, probe, spec, result)
    if hub_online or not _on_hub(spec.model.id):
        _check_model(ctx, probe, spec, result)
    try:
        check_hosting(spec)
    except RunStateError as error:
        field_name, _, message = str(error).partition(": ")
        result.errors[field_name] = message
    rows = _check_dataset(spec, store, result, sample_rows) if hub_online or not _hub_dataset(spec) else []
    if rows:
        _check_rewards(spec, rows, result, sandbox)
        _check_environment(spec, rows, result, sandbox)
        _check_held_out(spec, store, result)
    if not result.errors:
        result.plan = ctx.plan(probe, result.parameters).to_json()
    return result


def _check_reporting(
    ctx: PanelContext, owner: str, spec: RunSpec, wandb_credential_id: int | None, result: Preflight
) -> None:
    """W&B needs a key before anything is billed; a local run needs the reporting packages where its jobs run."""
    if spec.reporting.wandb:
        if wandb_credential_id is None:
            result.errors["reporting.wandb_key"] = (
                "Weights & Biases is ticked: save your W&B key on the Account page and pick it here, or untick it"
            )
        else:
            try:
                ctx.vault.wandb_key(owner, wandb_credential_id)
            except CredentialError as error:
                result.errors["reporting.wandb_key"] = f"{error}; pick a W&B key saved on the Account page"
    if spec.compute.backend == "local":
        for package in missing_packages(spec):
            name = package.split("==")[0]
            result.errors[f"reporting.{name}"] = (
                f"{package} is not installed where this panel runs its local jobs: run "
                "'pip install -r requirements-reporting.txt' in the panel's environment, or untick it"
            )


def _on_hub(model: str) -> bool:
    return model not in BUILTIN_MODELS and not model.startswith("/")


def _hub_dataset(spec: RunSpec) -> bool:
    """Whether loading the dataset needs the Hub: `datasets` reads an id that names a local folder from there."""
    return spec.dataset.source == "hub" and not Path(spec.dataset.id).is_dir()


def _check_hub(ctx: PanelContext, spec: RunSpec, result: Preflight) -> bool:
    """One short request to the Hub, made only when the spec needs the Hub; whether it answered.

    Offline, each Hub check would retry on its own (huggingface_hub's backoff: ~25 s for the dataset alone) before
    failing. HF Jobs cannot be submitted without the Hub: an error. Local jobs share this machine's network, so a Hub
    model or dataset they cannot reach is an error on that field: launched, the run failed a minute later, after both
    replicas had started. Whatever could not be checked is recorded as not checked.
    """
    hub_dataset = _hub_dataset(spec)
    if spec.compute.backend != "hf_jobs" and not hub_dataset and not _on_hub(spec.model.id):
        return True
    import httpx2
    from huggingface_hub import constants, get_session

    endpoint = ctx.hub_endpoint or constants.ENDPOINT
    try:
        get_session().head(endpoint, timeout=HUB_PROBE_TIMEOUT)
        return True
    except (OSError, httpx2.TransportError) as error:
        reason = f"the Hub ({endpoint}) did not answer the panel ({type(error).__name__})"
    if spec.compute.backend == "hf_jobs":
        result.errors["compute.backend"] = f"{reason}; HF Jobs are submitted through it: check this machine's network"
    local = spec.compute.backend == "local"
    if _on_hub(spec.model.id):
        result.unchecked["model"] = f"{spec.model.id}: {reason}"
        if local:
            result.errors["model.id"] = f"{reason}; {_LOCAL_JOBS_NEED_THE_HUB}, or give a model folder on this machine"
    if hub_dataset:
        result.unchecked["dataset"] = f"{spec.dataset.id}: {reason}"
        result.unchecked["rewards"] = "they are tried on the dataset's rows"
        if local:
            result.errors["dataset.id"] = f"{reason}; {_LOCAL_JOBS_NEED_THE_HUB}, or upload the dataset to the bucket"
    return False


def _check_store(ctx: PanelContext, run: Run, spec: RunSpec, result: Preflight) -> ObjectStore | None:
    if spec.storage.uri.startswith(("s3://", "hf://")) and run.store_credential_id is None:
        result.errors["storage.credentials"] = "this bucket needs an access key and secret; add them as credentials"
        return None
    try:
        store = ctx.fresh_store(run)
        store.probe()
        _check_region(store, spec, result)
        return store
    except StoreAccessError as error:
        message = str(error)
        if "credentials" in message:
            result.errors["storage.credentials"] = message
        elif "unreachable" in message:
            result.errors["storage.endpoint"] = message
        else:
            result.errors["storage.uri"] = message
    except StoreError as error:
        result.errors["storage.uri"] = f"the bucket did not answer reliably: {error}"
    except Exception as error:  # a credential that cannot be decrypted, a folder that cannot be created, ...
        result.errors["storage.credentials"] = str(error)
    return None


def _check_region(store: ObjectStore, spec: RunSpec, result: Preflight) -> None:
    """An S3 bucket's region must be known and right: the job bootstrap signs for it and cannot follow a redirect.
    Left empty, it is learnt when the run is created (RunService.create)."""
    if not spec.storage.uri.startswith("s3://"):
        return  # a local folder, or an HF bucket (its gateway has one region)
    try:
        actual = cast(S3Store, store).bucket_region()  # an s3:// uri opens an S3Store
    except StoreAccessError:  # keys limited to a prefix may not HEAD the bucket itself
        actual = None
    if actual is None and not spec.storage.region:
        result.errors["storage.region"] = (
            "the bucket did not say which region it is in; enter its region (e.g. 'eu-west-1')"
        )
    elif actual and spec.storage.region and spec.storage.region != actual:
        result.errors["storage.region"] = f"the bucket is in {actual}, not {spec.storage.region}; use {actual}"


def _check_compute(ctx: PanelContext, run: Run, spec: RunSpec, result: Preflight) -> None:
    if spec.compute.backend == "local":
        result.cost_per_hour = 0.0
        cores = os.cpu_count() or 1
        if spec.compute.replicas > max(2, cores):
            result.warnings.append(f"{spec.compute.replicas} replicas on {cores} cores will be slow")
        try:
            choose_engine(spec.compute.engine)  # the replicas will run here: is the engine asked for installed?
        except ValueError as error:
            result.errors["compute.engine"] = str(error)
        return
    try:
        hub_replica_engine(spec)
    except ValueError as error:
        result.errors["compute.engine"] = str(error)
    images = check_images(spec)
    result.errors.update(images.errors)
    result.warnings.extend(images.warnings)
    if run.hf_credential_id is None:
        result.errors["compute.token"] = "HF Jobs need an HF token that may run Jobs; add it as a credential"
        return
    if not spec.storage.uri.startswith(("s3://", "hf://")):
        result.errors["storage.uri"] = "HF Jobs cannot reach a local folder; use an hf:// or s3:// bucket"
    try:
        launcher = ctx.hf_launcher(run.owner, run.hf_credential_id)
        launcher.check_flavors(spec)
        result.cost_per_hour = estimate_per_hour(spec, launcher.prices_per_hour())
    except LaunchError as error:
        field_name = str(error).split(":", 1)[0] if str(error).startswith("compute.") else "compute.token"
        result.errors[field_name] = str(error).split(": ", 1)[-1] if field_name != "compute.token" else str(error)
    except ValueError as error:
        result.errors["compute.token"] = str(error)


def _check_model(ctx: PanelContext, run: Run, spec: RunSpec, result: Preflight) -> None:
    """The model exists where it is said to be, and TRL can read replies in its chat template
    (jobs/chat_templates.py)."""
    model = spec.model.id
    if model in BUILTIN_MODELS:
        return
    if model.startswith("/"):
        if not os.path.isfile(os.path.join(model, "config.json")):
            result.errors["model.id"] = f"{model} holds no config.json; point at a folder saved with save_pretrained"
        elif spec.compute.backend == "hf_jobs":
            result.errors["model.id"] = "HF Jobs cannot see this machine's folders; use a Hub model id"
        else:
            _check_chat_template(chat_template_in(model), spec, result)
        return
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    bound_hub_calls()  # the model's files are read through huggingface_hub's shared client
    token = ctx.vault.hf_token(run.owner, run.hf_credential_id) if run.hf_credential_id is not None else None
    api = HfApi(token=token, endpoint=ctx.hub_endpoint)
    try:
        info = api.model_info(model, revision=spec.model.revision, timeout=10)
        with tempfile.TemporaryDirectory() as folder:
            for name in [sibling.rfilename for sibling in info.siblings or [] if _preflight_reads(sibling.rfilename)]:
                api.hf_hub_download(model, name, revision=spec.model.revision, local_dir=folder)
            template = chat_template_in(folder)
            config = Path(folder) / "config.json"
            heads = json.loads(config.read_text()).get("num_attention_heads") if config.is_file() else None
    except GatedRepoError:
        result.errors["model.id"] = f"{model} is gated; accept its terms on the Hub and use a token that has access"
    except RepositoryNotFoundError:
        result.errors["model.id"] = f"{model} was not found on the Hub (or is private); check the id and the token"
    except HfHubHTTPError as error:
        result.errors["model.id"] = f"the Hub refused {model}: {str(error)[:200]}"
    except Exception as error:  # offline: say so; HF Jobs may still reach the Hub, local jobs would not
        reason = f"the Hub did not answer for {model} ({type(error).__name__})"
        result.unchecked["model"] = f"{model}: {reason}"
        if spec.compute.backend == "local":
            result.errors["model.id"] = f"{reason}; {_LOCAL_JOBS_NEED_THE_HUB}, or give a model folder on this machine"
    else:
        _check_chat_template(template, spec, result)
        if info.safetensors is not None and spec.compute.backend == "hf_jobs":
            result.parameters = info.safetensors.total
            _check_trainer_memory(info.safetensors.total, spec, result)
        if heads and spec.compute.backend == "hf_jobs":
            _check_tensor_parallel(heads, spec, result)


def _preflight_reads(name: str) -> bool:
    """Whether preflight downloads this file of a Hub model (the few small files the checks need)."""
    return name in MODEL_FILES or (name.startswith(f"{ADDITIONAL_TEMPLATES_DIR}/") and name.endswith(".jinja"))


def _check_tensor_parallel(heads: int, spec: RunSpec, result: Preflight) -> None:
    """vLLM splits the attention heads over a replica's GPUs: their count must divide the model's heads."""
    tensor_parallel = derived.replica_tensor_parallel(spec.compute)
    if heads % tensor_parallel:
        fitting = ", ".join(str(n) for n in range(1, heads + 1) if heads % n == 0 and n <= 8)
        result.errors["compute.replica_flavor"] = (
            f"{spec.model.id} has {heads} attention heads, which vLLM cannot split over the {tensor_parallel} GPUs of "
            f"{spec.compute.replica_flavor}; choose a flavor with {fitting} GPU(s)"
        )


def _check_trainer_memory(parameters: int, spec: RunSpec, result: Preflight) -> None:
    """Every trainer process holds the model's float32 weights, whole (DDP) or its share of them (FSDP): refuse a
    flavor whose GPUs cannot."""
    gpu = flavor(spec.compute.trainer_flavor)
    processes = spec.compute.training_ranks
    sharding = derived.trainer_sharding(spec.compute.trainer_sharding, processes, parameters, gpu.gpu_memory_gb)
    shards = processes if sharding == "fsdp" else 1
    if not gpu.gpus or derived.trainer_fits(parameters, gpu.gpu_memory_gb, shards):
        return
    held = (
        f"a 1/{shards} share of the float32 weights on each of its GPUs (FSDP)"
        if shards > 1
        else ("a whole float32 copy on every GPU")
    )
    fix = (
        "choose a flavor with more GPUs or more memory per GPU"
        if sharding == "fsdp"
        else "shard it over the GPUs (compute.trainer_sharding: fsdp or auto, with several GPUs) or choose a flavor "
        "with more memory per GPU"
    )
    result.errors["compute.trainer_flavor"] = (
        f"{spec.model.id} has {parameters / 1e9:.1f} B parameters: the trainer keeps {held} "
        f"({derived.trainer_weights_gb(parameters, shards):.0f} GB), more than {derived.TRAINER_WEIGHT_SHARE:.0%} of "
        f"the {gpu.gpu_memory_gb:g} GB each GPU of {gpu.name} has; {fix}"
    )


def _check_chat_template(template: str | dict[str, str] | None, spec: RunSpec, result: Preflight) -> None:
    try:
        response_template(template, spec.model.id, tools=spec.environment.enabled)
    except ChatTemplateError as error:
        result.errors["model.id"] = str(error).removeprefix("model.id: ")


def _check_dataset(
    spec: RunSpec, store: ObjectStore | None, result: Preflight, sample_rows: int
) -> list[dict[str, Any]]:
    if spec.dataset.source == "store" and store is None:
        return []
    try:
        rows = load_rows(spec.dataset, store, limit=sample_rows)
        check_columns(rows, spec.dataset)
        prompts = build_prompts(spec.dataset, rows)
    except DatasetError as error:
        field_name, _, message = str(error).partition(": ")
        result.errors[field_name if field_name.startswith("dataset") else "dataset.id"] = message or str(error)
        return []
    preview = [dict(row) for row in prompts]
    result.preview = preview
    return preview


def _check_held_out(spec: RunSpec, store: ObjectStore | None, result: Preflight) -> None:
    """The held-out prompts exist, have the dataset's columns, and some are left once the prompts shared with the
    training rows are dropped (how many were is said: the run records it too)."""
    if not spec.eval.enabled:
        return
    try:
        held = held_out(spec, store)
    except DatasetError as error:
        field_name, _, message = str(error).partition(": ")
        result.errors[field_name if field_name.startswith("eval") else "eval.split"] = message or str(error)
        return
    result.held_out = held
    if held.shared:
        result.warnings.append(
            f"{held.shared} of the {held.candidates} held-out prompts ({held.source}) also occur in the training rows "
            f"and are left out of evaluation; {len(held.rows)} are evaluated"
        )


def _check_environment(spec: RunSpec, rows: list[dict[str, Any]], result: Preflight, limits: SandboxLimits) -> None:
    """The user's environment code, loaded and tried in the sandbox on the sample rows as TRL would use it."""
    if spec.environment.kind != "code":
        return  # none, or a built-in: ours, tested with the code
    if not environment_packages_here(spec, result):
        return
    try:
        rehearse_environment(spec.environment, rows, limits)
    except SandboxError as error:
        field_name, _, message = str(error).partition(": ")
        if not field_name.startswith("environment."):  # the sandbox's own words: a limit, a refusal
            field_name, message = "environment.source", str(error)
        result.errors[field_name] = message


def environment_packages_here(spec: RunSpec, result: Preflight) -> bool:
    """Whether the packages the environment's code imports are installed here, where it is tried. A local run's
    jobs run here too: one that lacks them is refused. On HF Jobs the trainer installs them; the code is then left
    untried, said so, rather than refused for what the panel lacks."""
    lacking = missing(spec.environment.packages)
    if not lacking:
        return True
    if spec.compute.backend == "local":
        result.errors["environment.packages"] = (
            f"{', '.join(lacking)} not installed where this panel runs its local jobs: run "
            f"'pip install {' '.join(lacking)}' in the panel's environment, or remove it"
        )
    else:
        result.unchecked["environment.source"] = (
            f"not tried here: it imports {', '.join(lacking)}, which this panel lacks; the trainer installs "
            "environment.packages before it trains"
        )
    return False


def _check_rewards(spec: RunSpec, rows: list[dict[str, Any]], result: Preflight, limits: SandboxLimits) -> None:
    completions = [str(row.get("answer") or "") for row in rows]
    try:
        result.trials = run_rewards(scored_functions(spec), rows, completions, limits)
    except SandboxError as error:
        result.errors["rewards"] = str(error)
        return
    for field_name, trial in zip(function_fields(spec), result.trials, strict=True):
        if trial.error:
            where = f" (row {trial.row})" if trial.row is not None else ""
            result.errors[field_name] = f"{trial.name}{where}: {trial.error}"
