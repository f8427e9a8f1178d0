"""Adapter versions: download, compare, roll back (and branch), publish — for one owner's runs.

Every version a run published stays in its bucket. Comparing two versions looks at what each changed in the model:
for a LoRA module the update is ΔW = (alpha / r) · B·A; its Frobenius norm, the norm of the difference between two
versions' updates and their cosine similarity are computed from r×r products, without ever forming ΔW (which is as
large as the base weight).
"""

from __future__ import annotations

import json
import math
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import requests
from sqlmodel import col, select

from backend.context import PanelContext
from backend.database.models import AdapterVersion, Job, MetricPoint, Run
from backend.services.runs import RunService, RunStateError
from jobs.contract import BUILTIN_MODELS, RunSpec, derived, layout, parse_spec
from jobs.evaluation.results import VersionEval
from jobs.pins import pins
from jobs.store import download_published

if TYPE_CHECKING:
    from torch import Tensor

# Metrics shown side by side when comparing two versions.
COMPARED_METRICS = ("reward", "ratio", "kl", "entropy", "completions/mean_length", "sample/staleness_mean")
LOCAL_GENERATION_MAX_PARAMS = 600_000_000


class VersionNotFound(LookupError):
    pass


@dataclass
class ModuleDelta:
    module: str
    norm_a: float
    norm_b: float
    diff_norm: float
    cosine: float | None


@dataclass
class Comparison:
    run_id: str
    version_a: int
    version_b: int
    step_a: int | None
    step_b: int | None
    modules: list[ModuleDelta]
    total_norm_a: float
    total_norm_b: float
    total_diff_norm: float
    total_cosine: float | None
    metrics: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)


def lora_pairs(weights: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{module: (A, B)} from an adapter's safetensors keys (`...lora_A.weight` / `...lora_B.weight`)."""
    pairs: dict[str, dict[str, Any]] = {}
    for key, tensor in weights.items():
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in key:
                module = key.split(marker)[0].removeprefix("base_model.model.")
                pairs.setdefault(module, {})[part] = tensor.double()
    return {module: (p["lora_A"], p["lora_B"]) for module, p in pairs.items() if len(p) == 2}


def _inner(a1: Tensor, b1: Tensor, s1: float, a2: Tensor, b2: Tensor, s2: float) -> float:
    """<s1·B1A1, s2·B2A2>_F = s1·s2·trace((B1ᵀB2)(A2A1ᵀ)), computed with r×r matrices."""
    return float(s1 * s2 * ((b1.T @ b2) * (a1 @ a2.T)).sum())


def compare_weights(a: dict[str, Any], b: dict[str, Any], scale_a: float, scale_b: float) -> list[ModuleDelta]:
    pairs_a, pairs_b = lora_pairs(a), lora_pairs(b)
    deltas = []
    for module in sorted(set(pairs_a) | set(pairs_b)):
        ab, bb = pairs_a.get(module), pairs_b.get(module)
        aa = _inner(*ab, scale_a, *ab, scale_a) if ab else 0.0
        bbn = _inner(*bb, scale_b, *bb, scale_b) if bb else 0.0
        cross = _inner(*ab, scale_a, *bb, scale_b) if ab and bb else 0.0
        norm_a, norm_b = math.sqrt(max(aa, 0.0)), math.sqrt(max(bbn, 0.0))
        diff = math.sqrt(max(aa + bbn - 2 * cross, 0.0))
        cosine = cross / (norm_a * norm_b) if norm_a > 0 and norm_b > 0 else None
        deltas.append(ModuleDelta(module, norm_a, norm_b, diff, cosine))
    return deltas


class AdapterService:
    def __init__(self, ctx: PanelContext, owner: str):
        self.ctx, self.owner = ctx, owner
        self.runs = RunService(ctx, owner)

    def versions(self, run_id: str) -> list[AdapterVersion]:
        self.runs.get(run_id)
        with self.ctx.db.session() as session:
            return list(
                session.exec(
                    select(AdapterVersion).where(AdapterVersion.run_id == run_id).order_by(col(AdapterVersion.version))
                ).all()
            )

    def version(self, run_id: str, version: int) -> AdapterVersion:
        self.runs.get(run_id)
        with self.ctx.db.session() as session:
            row = session.exec(
                select(AdapterVersion).where(AdapterVersion.run_id == run_id, AdapterVersion.version == version)
            ).first()
        if row is None:
            raise VersionNotFound(f"run {run_id} has no adapter version {version}")
        return row

    def local_copy(self, run_id: str, version: int, folder: Path) -> Path:
        self.version(run_id, version)  # owner check and existence
        run = self.runs.get(run_id)
        target = folder / f"{run_id}-v{version}"
        download_published(self.ctx.store_for(run), layout.adapter_prefix(run_id, version), target)
        return target

    # --- download -------------------------------------------------------------------------------------------------

    def download_zip(self, run_id: str, version: int) -> Path:
        """A zip of the version as it travels (`portable_copy`); unzip it and `AutoPeftModelForCausalLM` loads it."""
        out_dir = self.ctx.folder / "downloads" / self.owner
        out_dir.mkdir(parents=True, exist_ok=True)
        target = out_dir / f"{run_id}-v{version}.zip"
        with tempfile.TemporaryDirectory() as folder:
            source = self.portable_copy(run_id, version, Path(folder))
            temp = target.with_suffix(".zip.tmp")
            with zipfile.ZipFile(temp, "w", zipfile.ZIP_DEFLATED) as archive:
                for path in sorted(source.rglob("*")):
                    if path.is_file():
                        archive.write(path, path.relative_to(source).as_posix())
            temp.replace(target)
        return target

    # --- compare --------------------------------------------------------------------------------------------------

    def compare(self, run_id: str, version_a: int, version_b: int) -> Comparison:
        from safetensors.torch import load_file

        row_a, row_b = self.version(run_id, version_a), self.version(run_id, version_b)
        with tempfile.TemporaryDirectory() as folder:
            paths = [self.local_copy(run_id, v, Path(folder)) for v in (version_a, version_b)]
            weights = [load_file(str(p / "adapter_model.safetensors")) for p in paths]
            scales = [_lora_scale(p / "adapter_config.json") for p in paths]
        modules = compare_weights(weights[0], weights[1], *scales)
        total_a = math.sqrt(sum(m.norm_a**2 for m in modules))
        total_b = math.sqrt(sum(m.norm_b**2 for m in modules))
        cross = sum(((m.norm_a**2 + m.norm_b**2 - m.diff_norm**2) / 2) for m in modules)
        return Comparison(
            run_id=run_id,
            version_a=version_a,
            version_b=version_b,
            step_a=row_a.step,
            step_b=row_b.step,
            modules=modules,
            total_norm_a=total_a,
            total_norm_b=total_b,
            total_diff_norm=math.sqrt(sum(m.diff_norm**2 for m in modules)),
            total_cosine=cross / (total_a * total_b) if total_a > 0 and total_b > 0 else None,
            metrics={
                name: (self._metric_at(run_id, name, row_a.step), self._metric_at(run_id, name, row_b.step))
                for name in COMPARED_METRICS
            },
        )

    def _metric_at(self, run_id: str, name: str, step: int | None) -> float | None:
        if step is None:
            return None
        with self.ctx.db.session() as session:
            return session.exec(
                select(MetricPoint.value)
                .where(MetricPoint.run_id == run_id, MetricPoint.name == name, MetricPoint.step <= max(step, 1))
                .order_by(col(MetricPoint.step).desc())
            ).first()

    # --- generations ------------------------------------------------------------------------------------------------

    def generate(
        self, run_id: str, versions: list[int], prompts: list[str], max_tokens: int = 64
    ) -> dict[int, list[str]]:
        """Completions of `prompts` under each version: through a live replica that holds it, else locally."""
        run = self.runs.get(run_id)
        spec = RunSpec.from_json(run.spec_json)
        results: dict[int, list[str]] = {}
        for version in versions:
            self.version(run_id, version)
            live = self._generate_live(run, spec, version, prompts, max_tokens)
            results[version] = (
                live if live is not None else self._generate_local(run_id, spec, version, prompts, max_tokens)
            )
        return results

    def _generate_live(
        self, run: Run, spec: RunSpec, version: int, prompts: list[str], max_tokens: int
    ) -> list[str] | None:
        with self.ctx.db.session() as session:
            endpoints = session.exec(
                select(Job.endpoint).where(Job.run_id == run.id, Job.stage == "running", col(Job.endpoint).is_not(None))
            ).all()
        if not endpoints:
            return None
        token = self.ctx.secrets_for(run).replica_token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        name = derived.replica_adapter_name(run.id, version)
        try:
            texts = []
            for prompt in prompts:
                body: dict[str, Any] = {
                    "model": name,
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": max_tokens,
                    "temperature": 0.0,
                    "seed": 0,
                }
                response = requests.post(
                    str(endpoints[0]).rstrip("/") + "/v1/chat/completions", json=body, headers=headers, timeout=120
                )
                if response.status_code != 200:
                    return None  # the replica no longer holds this version: fall back to local generation
                texts.append(response.json()["choices"][0]["message"]["content"])
            return texts
        except (requests.RequestException, KeyError, ValueError):
            return None

    def _generate_local(
        self, run_id: str, spec: RunSpec, version: int, prompts: list[str], max_tokens: int
    ) -> list[str]:
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from jobs.models import resolve_model

        model_path = resolve_model(spec.model)
        ensure_generates_here(spec, model_path, "compare generations while the run's replicas are up")
        with tempfile.TemporaryDirectory() as folder:
            adapter = self.local_copy(run_id, version, Path(folder))
            tokenizer = AutoTokenizer.from_pretrained(model_path, revision=spec.model.revision, padding_side="left")
            base = AutoModelForCausalLM.from_pretrained(model_path, revision=spec.model.revision, dtype=torch.float32)
            model: Any = PeftModel.from_pretrained(base, str(adapter)).eval()  # transformers' generate is untyped
            texts: list[str] = []
            for prompt in prompts:
                ids: Any = tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}],
                    add_generation_prompt=True,
                    return_tensors="pt",
                    return_dict=True,
                )
                with torch.no_grad():
                    out = model.generate(
                        **ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
                    )
                text = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
                texts.append(str(text))
        return texts

    # --- roll back and branch ---------------------------------------------------------------------------------------

    def make_current(self, run_id: str, version: int) -> None:
        """Point the run's `adapters/CURRENT` at `version` (later versions are kept)."""
        self.version(run_id, version)
        run = self.runs.get(run_id)
        self.ctx.store_for(run).put_bytes(layout.current_key(run_id), str(version).encode())
        with self.ctx.db.session() as session:
            row = session.get_one(Run, run_id)
            row.current_version = version
            session.add(row)
            session.commit()

    def branch(
        self,
        run_id: str,
        version: int,
        new_run_id: str,
        overrides: dict[str, dict[str, Any]] | None = None,
        launch: bool = True,
    ) -> Run:
        """A new run that trains on from `version` of `run_id`, with the parent's settings unless overridden.

        Model and LoRA settings cannot change: the branch starts from the parent's adapter weights.
        """
        self.version(run_id, version)
        parent = self.runs.get(run_id)
        data = json.loads(parent.spec_json)
        for section, values in (overrides or {}).items():
            if section in ("model", "lora"):
                raise RunStateError(f"{section}: a branch keeps its parent's {section} settings")
            data[section] = {**data[section], **values} if isinstance(data.get(section), dict) else values
        data.update(
            run_id=new_run_id, name=f"{parent.name} ↳ v{version}", parent={"run_id": run_id, "version": version}
        )
        spec = parse_spec(data)
        child = self.runs.create(spec, parent.store_credential_id, parent.hf_credential_id, parent.wandb_credential_id)
        self.make_current(run_id, version)  # only once the branch exists: a refused branch moves nothing
        if launch:
            self.runs.launch(child.id)
        return self.runs.get(child.id)

    # --- publish ----------------------------------------------------------------------------------------------------

    def portable_copy(self, run_id: str, version: int, folder: Path) -> Path:
        """The version as it leaves the panel (a zip, a Hub repo): its files, verified against the manifest (which
        stays behind), a model card saying where it came from, and a config that names the base model by its Hub id.

        TRL saves the trainer's own view of the base model (a local snapshot folder on the trainer's machine; the
        demo model's build folder), which no other machine has: `AutoPeftModelForCausalLM` would fail on it.
        """
        run = self.runs.get(run_id)
        spec = RunSpec.from_json(run.spec_json)
        row = self.version(run_id, version)
        adapter = self.local_copy(run_id, version, folder)
        (adapter / "manifest.json").unlink(missing_ok=True)
        config_path = adapter / "adapter_config.json"
        config = json.loads(config_path.read_text())
        config["base_model_name_or_path"] = spec.model.id
        config["revision"] = spec.model.revision
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        metrics = {name: self._metric_at(run_id, name, row.step) for name in COMPARED_METRICS}
        held_out = self.newest_evaluation(run_id, version)
        (adapter / "README.md").write_text(model_card(spec, version, row.step, metrics, held_out))
        return adapter

    def newest_evaluation(self, run_id: str, version: int) -> VersionEval | None:
        """The version's most recent held-out evaluation kept in the run's bucket (`python -m backend eval`), if any."""
        store = self.ctx.store_for(self.runs.get(run_id))
        name = "/" + layout.eval_file(version)
        kept = [info for info in store.list(layout.eval_prefix(run_id)) if info.key.endswith(name)]
        if not kept:
            return None
        return VersionEval.from_json(store.get_bytes(max(kept, key=lambda info: info.modified).key))

    def publish(self, run_id: str, version: int, repo_id: str, private: bool = True) -> str:
        """Upload the version to a Hub model repo (created if needed) with the owner's token; returns its URL."""
        from huggingface_hub import HfApi

        run = self.runs.get(run_id)
        if run.hf_credential_id is None:
            raise RunStateError("publishing needs an HF token with write access; add one as a credential")
        api = HfApi(token=self.ctx.vault.hf_token(self.owner, run.hf_credential_id), endpoint=self.ctx.hub_endpoint)
        with tempfile.TemporaryDirectory() as folder:
            adapter = self.portable_copy(run_id, version, Path(folder))
            api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
            api.upload_folder(
                folder_path=str(adapter),
                repo_id=repo_id,
                repo_type="model",
                commit_message=f"{run_id} adapter v{version}",
            )
        return f"{api.endpoint}/{repo_id}"


def model_card(
    spec: RunSpec,
    version: int,
    step: int | None,
    metrics: dict[str, float | None],
    held_out: VersionEval | None = None,
) -> str:
    """A Hub model card for one adapter version: its base model, data, rewards, run and metrics, its held-out
    evaluation (also as `model-index` metadata, which the Hub shows), the versions of TRL and PEFT that trained it,
    and how to load it."""
    model = spec.model.id
    on_hub = model not in BUILTIN_MODELS and not model.startswith("/")
    front = [f"base_model: {model}"] if on_hub else []
    tags = ([f"base_model:adapter:{model}"] if on_hub else []) + ["grpo", "lora", "peft", "trl", "async-grpo"]
    front += ["library_name: peft", f"tags: [{', '.join(tags)}]"]
    if held_out is not None:
        front += _model_index(spec, version, held_out)
    rewards = ", ".join(f"`{r.name}` (weight {r.weight:g})" for r in spec.rewards)
    shown = "\n".join(f"| {name} | {value:.4f} |" for name, value in metrics.items() if value is not None)
    revision = f" at revision `{spec.model.revision}`" if spec.model.revision else ""
    versions = pins()
    trained_with = ", ".join(f"{name} {versions.get(name.lower(), '?')}" for name in ("TRL", "PEFT"))
    front_matter = "\n".join(front)
    return f"""---
{front_matter}
---

# {spec.name or spec.run_id} — adapter v{version}

A LoRA adapter (rank {spec.lora.rank}, alpha {spec.lora.alpha:g}, targets {spec.lora.target_modules}) trained with
asynchronous GRPO (TRL's AsyncGRPOTrainer) on `{model}`{revision}.

- Run: `{spec.run_id}`, adapter version {version}, optimizer step {step}
- Dataset: `{spec.dataset.id}` ({spec.dataset.split}), prompt column `{spec.dataset.prompt_column}`
- Rewards: {rewards}
- GRPO: {spec.grpo.num_generations} generations per prompt, learning rate {spec.grpo.learning_rate:g}, max staleness
  {spec.grpo.max_staleness}, temperature {spec.grpo.temperature:g}
- Trained with {trained_with}

| metric at this step | value |
|---|---|
{shown}
{_evaluation_section(held_out)}
## How to load it

{_loading(model, on_hub)}
"""


def _evaluation_section(held_out: VersionEval | None) -> str:
    if held_out is None:
        return ""
    rows = "\n".join(
        f"| {name} | {summary.avg.mean:.4f} | [{summary.avg.low:.4f}, {summary.avg.high:.4f}] |"
        for name, summary in ((name, held_out.summary(name)) for name in held_out.scores)
    )
    return f"""
## Held-out evaluation

On {len(held_out.prompts)} prompts it never trained on ({held_out.source}), {held_out.k} samples each:

| score | mean | 95 % interval over prompts |
|---|---|---|
{rows}
"""


def _model_index(spec: RunSpec, version: int, held_out: VersionEval) -> list[str]:
    """The held-out scores as the Hub's `model-index` metadata (YAML lines of the card's front matter)."""
    split = spec.eval.split or spec.dataset.split
    lines = [
        "model-index:",
        f"- name: {spec.run_id}-v{version}",
        "  results:",
        "  - task:",
        "      type: text-generation",
        "    dataset:",
        f"      name: {json.dumps(spec.dataset.id)}",
        f"      type: {json.dumps(spec.dataset.id)}",
        f"      split: {json.dumps(split)}",
        "    metrics:",
    ]
    for name in held_out.scores:
        lines += [
            f"    - type: {json.dumps(name)}",
            f"      value: {held_out.summary(name).avg.mean:.4f}",
            f"      name: {json.dumps(f'held-out {name} (avg@{held_out.k}, {held_out.source})')}",
        ]
    return lines


def _loading(model: str, on_hub: bool) -> str:
    """How to load the adapter: by itself where the base model is on the Hub; otherwise, what is missing."""
    if on_hub:
        return f"""```python
from peft import AutoPeftModelForCausalLM

model = AutoPeftModelForCausalLM.from_pretrained("<this repo or folder>")  # fetches {model} too
```"""
    if model in BUILTIN_MODELS:
        return f"""The base model, `{model}`, is one of the panel's built-in demo models: it is built locally and has
no Hub id, so this adapter loads only beside the panel's code, which builds it:

```python
from peft import PeftModel
from transformers import AutoModelForCausalLM

from jobs.models import builtin_model_folder

base = AutoModelForCausalLM.from_pretrained(builtin_model_folder("{model}"))
model = PeftModel.from_pretrained(base, "<this folder>")
```"""
    return f"""The base model was a local folder, `{model}`, not a Hub id: load it from that folder, then apply
this adapter with `PeftModel.from_pretrained(base, "<this repo or folder>")`."""


def _lora_scale(config_path: Path) -> float:
    config = json.loads(config_path.read_text())
    rank = config.get("r") or 1
    alpha = config.get("lora_alpha") or rank
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def ensure_generates_here(spec: RunSpec, model_path: str, instead: str) -> None:
    """Refuse a model too large for the panel's own CPU; `instead` says what the user can do."""
    from transformers import AutoConfig

    params = _estimate_params(AutoConfig.from_pretrained(model_path, revision=spec.model.revision))
    if params > LOCAL_GENERATION_MAX_PARAMS:
        raise RunStateError(
            f"{spec.model.id} has about {params / 1e9:.1f}B parameters, too large to generate on the panel; {instead}"
        )


def _estimate_params(config: Any) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text, "hidden_size", 0)
    layers = getattr(text, "num_hidden_layers", 0)
    vocab = getattr(text, "vocab_size", 0)
    intermediate = getattr(text, "intermediate_size", 4 * hidden)
    return layers * (4 * hidden * hidden + 3 * hidden * intermediate) + 2 * vocab * hidden
