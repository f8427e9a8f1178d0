"""Held-out evaluation of a run's stored versions on this machine: the embedded default's CPU engine serves the
run's model, each version is loaded under its own LoRA name for its turn, and the run's rewards score the
completions in the reward sandbox, as they did in Check settings.

Results go to the run's bucket under the hash of what they depend on (jobs/evaluation/results.py): asking again reads
them back, changing the prompts, the sampling or the rewards evaluates again.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from backend.context import PanelContext
from backend.database.models import AdapterVersion, Run
from backend.hosting import on_space
from backend.ingestion.alerts import best_by_training_reward, update_best_version
from backend.ingestion.ingest import ingest_eval
from backend.launchers.base import LaunchError
from backend.sandbox.client import SandboxError, SandboxLimits, run_rewards
from backend.services.adapters import AdapterService, ensure_generates_here
from backend.services.evaluation_job import EvaluationJobError, EvaluationJobReport, run_evaluation_job
from backend.services.runs import RunService
from jobs.contract import EnvironmentSpec, EvalSpec, RunSpec, SpecError, derived, parse_spec
from jobs.evaluation.engine import EngineError, local_engine
from jobs.evaluation.heldout import HeldOut, eval_prompts, held_out
from jobs.evaluation.results import (
    TOTAL,
    VersionEval,
    function_fields,
    interval_json,
    result_key,
    score_names,
    score_table,
    scored_functions,
    stored_result,
    summary_json,
)
from jobs.evaluation.sampling import Completion, Sampling, SamplingError
from jobs.evaluation.statistics import Paired, paired
from jobs.evaluation.versions import evaluate_versions

VERSION_WORDS = "numbers (0: the base model), last, all, every:N or best-reward"
# The reward sandbox's time for one scoring call grows with the completions it scores (start-up aside).
SANDBOX_SECONDS_PER_COMPLETION = 0.05


class EvaluationError(ValueError):
    """The evaluation cannot run as asked; the message names the field or the version and what to do."""


@dataclass(frozen=True)
class Evaluation:
    """The versions asked for, each with its result, and whether it was read back from the bucket."""

    held_out: HeldOut
    sampling: Sampling
    results: list[VersionEval]
    cached: list[bool]
    job: EvaluationJobReport | None = None  # the evaluator job on HF Jobs that scored the versions not cached


@dataclass(frozen=True)
class PromptDifference:
    """One held-out prompt: each version's mean score over its samples, and each version's first completion."""

    prompt: str
    score_a: float
    score_b: float
    completion_a: str
    completion_b: str


class EvaluationService:
    def __init__(self, ctx: PanelContext, owner: str):
        self.ctx, self.owner = ctx, owner
        self.runs = RunService(ctx, owner)
        self.adapters = AdapterService(ctx, owner)

    def evaluate(
        self,
        run_id: str,
        versions: list[int],
        changes: dict[str, Any] | None = None,
        on_progress: Callable[[str], None] = lambda message: None,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> Evaluation:
        """Evaluate `versions` of the run (0: the base model) on its held-out prompts; `changes` alter its eval
        settings for this evaluation (a held-out split, the prompt count, k, greedy, metrics). A run on HF Jobs is
        evaluated by one job there (`on_progress` hears how it goes; `cancelled` ends it); a local run, here."""
        run = self.runs.get(run_id)
        spec = self.spec(run, changes or {})
        for version in versions:
            if version:
                self.adapters.version(run_id, version)  # the owner's run, and a version it holds
        store = self.ctx.store_for(run)
        held = held_out(spec, store)
        sampling = Sampling.of(spec)
        key = result_key(spec, held, sampling)
        found = {version: stored_result(store, run_id, version, key) for version in versions}
        missing = [version for version, result in found.items() if result is None]
        job = None
        try:
            if missing and run.backend == "hf_jobs":
                job = run_evaluation_job(self.ctx, run, spec, missing, on_progress, cancelled)
                fresh = self._stored(store, run_id, missing, key, job)
            else:
                fresh = self._evaluate_here(run, spec, held, sampling, key, missing, store) if missing else {}
        except (EngineError, SamplingError, SandboxError, EvaluationJobError, LaunchError) as error:
            raise EvaluationError(f"the evaluation of run {run_id} failed: {error}") from None  # said, no traceback
        results = [found[version] or fresh[version] for version in versions]
        if not changes:
            self._keep_scores(run, results)
        return Evaluation(held, sampling, results, [found[version] is not None for version in versions], job)

    def _keep_scores(self, run: Run, results: list[VersionEval]) -> None:
        """Scores under the run's own eval settings join those of its evaluation during the run (the versions table's
        held-out column, the `best` alias), each once; under other settings they are not comparable and are not
        kept."""
        steps = {version.version: version.step for version in self.adapters.versions(run.id)}
        records = [result.record(steps.get(result.version) or 0) for result in results]
        with self.ctx.db.session(write_lock=True) as session:
            ingest_eval(session, run.id, run.owner, records)
            current = session.get(Run, run.id)
            if current is not None:
                update_best_version(session, current)
                session.add(current)
            session.commit()

    @staticmethod
    def _stored(
        store: Any, run_id: str, versions: list[int], key: str, job: EvaluationJobReport
    ) -> dict[int, VersionEval]:
        """What the evaluator job stored: each version's result under `key`."""
        results = {version: stored_result(store, run_id, version, key) for version in versions}
        lost = [f"v{version}" for version, result in results.items() if result is None]
        if lost:
            raise EvaluationJobError(f"the evaluator job ended without a result for {', '.join(lost)} ({job.url})")
        return {version: result for version, result in results.items() if result is not None}

    def versions_named(self, run_id: str, words: list[str]) -> list[int]:
        """Version numbers from words, each once, in order: numbers (0: the base model), `last`, `all`, `every:N`
        (every Nth version, as the run's own evaluation picks them, and the last) or `best-reward` (the version with
        the highest training reward)."""
        stored = self.adapters.versions(run_id)
        numbers: list[int] = []
        for word in words:
            if word.isdigit():
                numbers.append(int(word))
                continue
            if word in ("last", "best-reward") or word.startswith("every:"):
                _need_versions(run_id, stored, word)
            if word == "all":
                numbers += [0, *(version.version for version in stored)]
            elif word == "last":
                numbers.append(stored[-1].version)
            elif word.startswith("every:"):
                branch = self.runs.get(run_id).parent_run_id is not None
                numbers += _every(word, [version.version for version in stored], branch)
            elif word == "best-reward":
                numbers.append(_best_by_training_reward(run_id, stored))
            else:
                raise EvaluationError(f"versions: {word!r} is not a version; give {VERSION_WORDS}")
        if not numbers:
            raise EvaluationError(f"versions: name at least one version; give {VERSION_WORDS}")
        return list(dict.fromkeys(numbers))

    def report(self, evaluation: Evaluation) -> dict[str, Any]:
        """The evaluation as plain data (the API's answer): per version each score's mean and 95 % interval, and for
        two versions their paired comparison on the total reward."""
        held, sampling = evaluation.held_out, evaluation.sampling
        versions = []
        for result, cached in zip(evaluation.results, evaluation.cached, strict=True):
            scores = {name: summary_json(result.summary(name)) for name in result.scores}
            versions.append({"version": result.version, "scores": scores, "cached": cached, "seconds": result.seconds})
        comparison = None
        if len(evaluation.results) == 2:
            a, b = (result.version for result in evaluation.results)
            paired_scores = self.compare(evaluation, a, b)
            comparison = {
                "a": a,
                "b": b,
                "difference": interval_json(paired_scores.difference),
                "wins": paired_scores.wins,
                "ties": paired_scores.ties,
                "losses": paired_scores.losses,
            }
        return {
            "prompts": len(held.rows),
            "source": held.source,
            "shared_with_training": held.shared,
            "sampling": sampling.describe(),
            "versions": versions,
            "comparison": comparison,
            "job": None if evaluation.job is None else asdict(evaluation.job),  # HF Jobs: url, flavor, seconds, cost
        }

    def differences(
        self, evaluation: Evaluation, a: int, b: int, most: int = 5, score: str = TOTAL
    ) -> list[PromptDifference]:
        """The held-out prompts on which versions a and b scored most apart, each with both first completions."""
        by_version = {result.version: result for result in evaluation.results}
        first, second = by_version[a], by_version[b]
        means_a, means_b = first.summary(score).per_prompt, second.summary(score).per_prompt
        rows = [
            PromptDifference(prompt, means_a[i], means_b[i], first.completions[i][0], second.completions[i][0])
            for i, prompt in enumerate(first.prompts)
        ]
        return sorted(rows, key=lambda row: abs(row.score_b - row.score_a), reverse=True)[:most]

    def compare(self, evaluation: Evaluation, a: int, b: int, score: str = TOTAL) -> Paired:
        """Version b against version a, prompt by prompt, on one evaluation's held-out prompts."""
        by_version = {result.version: result for result in evaluation.results}
        return paired(by_version[a].summary(score).per_prompt, by_version[b].summary(score).per_prompt)

    def spec(self, run: Run, changes: dict[str, Any]) -> RunSpec:
        """The run's spec with its eval settings changed. Rows carved off the training split are held out only if
        the run carved them: carving others now would score prompts it trained on."""
        stored = self.ctx.spec(run)
        try:
            spec = parse_spec(
                {**stored.model_dump(mode="json"), "eval": {**stored.eval.model_dump(), **changes}}, stored=True
            )
        except SpecError as error:
            raise EvaluationError(str(error)) from None
        settings, carved = spec.eval, (stored.eval.holdout, stored.eval.seed)
        if settings.holdout is not None and (settings.holdout, settings.seed) != carved:
            raise EvaluationError(
                f"eval.holdout: run {run.id} trained on {_held_out_words(stored.eval)}; rows carved now were trained "
                "on. Name a held-out split instead"
            )
        if not settings.enabled:
            raise EvaluationError(
                f"eval.split: run {run.id} has no held-out prompts; name a split of its dataset it did not train on "
                "(e.g. --split test)"
            )
        return spec

    def _evaluate_here(
        self, run: Run, spec: RunSpec, held: HeldOut, sampling: Sampling, key: str, versions: list[int], store: Any
    ) -> dict[int, VersionEval]:
        from transformers import AutoTokenizer

        from jobs.models import eos_token_ids, resolve_model
        from jobs.replica.engine_command import choose_engine

        refused = environment_refusal(run.id, spec.environment, on_space())
        if refused is not None:
            raise EvaluationError(refused)
        model_path = resolve_model(spec.model)
        ensure_generates_here(spec, model_path, "a run on HF Jobs is evaluated by a job of its own there")
        tokenizer = AutoTokenizer.from_pretrained(model_path, revision=spec.model.revision)
        eos = eos_token_ids(model_path, tokenizer.eos_token_id, spec.model.revision)
        prompts = eval_prompts(spec, held, tokenizer, eos)
        engine = choose_engine(spec.compute.engine)  # the run's own engine: vLLM's CPU build for a vLLM run
        with local_engine(spec, model_path, engine) as url, tempfile.TemporaryDirectory(prefix="eval-") as folder:
            return evaluate_versions(
                url,
                spec,
                prompts,
                sampling,
                key,
                versions,
                lambda version: self.adapters.local_copy(run.id, version, Path(folder)),
                lambda prompts, sampled: _score(spec, prompts.records, sampled, eos),
                store,
            )


def environment_refusal(run_id: str, environment: EnvironmentSpec, space: bool) -> str | None:
    """Why the panel will not evaluate a run with these tools itself (None: it will). Code the panel did not write
    runs only in its sandbox, where no engine answers: so never the user's own environment, and on a Space (`space`:
    many users share the process) not the programs the model writes for the `python` tool either."""
    if environment.kind == "code" or (environment.kind == "builtin" and environment.name == "python" and space):
        return (
            f"environment: run {run_id}'s tools run code this panel runs only in its sandbox, where no engine "
            "answers (your environment's, or on a Space the model's programs); its versions are evaluated while "
            "it trains (eval.split or eval.holdout at launch)"
        )
    return None


def _score(
    spec: RunSpec, records: list[dict[str, Any]], sampled: list[list[Completion]], eos: list[int]
) -> dict[str, list[list[float]]]:
    """Per score (jobs/evaluation/results.py's `score_table`), per prompt, per sample, scored in the sandbox on the
    completions' own token ids, as in training (a length or EOS-aware reward reads them)."""
    k = len(sampled[0])
    rows = [record for record in records for _ in range(k)]
    flat = [completion for completions in sampled for completion in completions]
    limits = SandboxLimits(seconds=max(SandboxLimits.seconds, SANDBOX_SECONDS_PER_COMPLETION * len(flat)))
    scored, ids = [c.scored() for c in flat], [c.token_ids for c in flat]
    trials = run_rewards(scored_functions(spec), rows, scored, limits, eos_token_ids=eos, completion_ids=ids)
    for field_name, trial in zip(function_fields(spec), trials, strict=True):
        if trial.error:
            raise EvaluationError(f"{field_name}: {trial.name} failed on a held-out completion: {trial.error}")
    return score_table(score_names(spec), [trial.scores for trial in trials], k)


def _need_versions(run_id: str, stored: list[AdapterVersion], word: str) -> None:
    if not stored:
        raise EvaluationError(f"versions: run {run_id} has no version yet; {word!r} names none")


def _every(word: str, stored: list[int], branch: bool) -> list[int]:
    """`every:N`: the versions the run's own evaluation would pick at interval N (`derived.version_due`: on a
    branch, v1, its starting point), and the last."""
    interval = word.split(":", 1)[1]
    if not interval.isdigit() or int(interval) < 1:
        raise EvaluationError(f"versions: {word!r} needs a whole number of versions from 1 up, e.g. every:10")
    return [version for version in stored if derived.version_due(version, int(interval), branch)] + stored[-1:]


def _best_by_training_reward(run_id: str, stored: list[AdapterVersion]) -> int:
    best = best_by_training_reward(stored)
    if best is None:
        raise EvaluationError(f"versions: no version of run {run_id} has a training reward yet; best-reward names none")
    return best.version


def _held_out_words(settings: EvalSpec) -> str:
    if settings.holdout is None:
        return "every row of its training split"
    return f"all but {settings.holdout} rows carved with seed {settings.seed}"
