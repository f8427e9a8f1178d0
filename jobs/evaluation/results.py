"""One version's evaluation as it is kept in the store: every completion, every score, and their summaries.

A result is keyed by what it depends on (the held-out prompts, the sampling, the score functions), so asking for the
same evaluation again reads it back and changing any of them evaluates again.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypedDict

from jobs.contract import RewardSpec, RunSpec, layout
from jobs.evaluation.heldout import HeldOut
from jobs.evaluation.sampling import Sampling
from jobs.evaluation.statistics import Interval, interval, is_binary, pass_at_k
from jobs.store import ObjectNotFound, ObjectStore

TOTAL = "reward"  # the sum of the weighted rewards, as TRL's `reward` metric


class IntervalJson(TypedDict, total=False):
    """An interval as `interval_json` writes it. Not total, as a score's (`EvalScore`) are read from what any evaluator
    sent (`EvalRecord`)."""

    mean: float
    low: float | None
    high: float | None


class EvalScore(IntervalJson, total=False):
    """One score as JSON carries it (`summary_json`): avg@k with its 95 % interval, and pass@k for 0/1 scores (else
    None)."""

    pass_at_k: float | None


class EvalRecord(TypedDict, total=False):
    """The `eval` telemetry stream's record of one version: `VersionEval.record`, with the tokens generated added by
    jobs/evaluation/during_run.py's `telemetry_record`, which the panel reads back (backend/ingestion/ingest.py,
    `eval_rows`). No key is required: the panel reads what any evaluator sent, and takes each key with a default."""

    time: float
    version: int
    step: int
    key: str  # the settings key (`result_key`): scores under different keys are not comparable
    prompts: int
    k: int
    seconds: float
    scores: dict[str, EvalScore]
    tokens: int  # generated for it, what evaluation costs beside the rollouts (`telemetry_record` adds it)


@dataclass(frozen=True)
class ScoreSummary:
    """One score function over the held-out prompts: per prompt, the mean of its k samples; over prompts, avg@k with
    its 95 % interval; for 0/1 scores, the mean unbiased pass@k."""

    per_prompt: list[float]
    avg: Interval
    pass_at_k: float | None


@dataclass(frozen=True)
class VersionEval:
    run_id: str
    version: int  # 0: the base model
    key: str  # what the result depends on (`result_key`)
    source: str  # where the held-out prompts came from, in words: "split 'test'"
    sampling: dict[str, Any]  # jobs.evaluation.sampling.Sampling, as plain data
    k: int
    prompts: list[str]
    completions: list[list[str]]  # per prompt, its k samples
    scores: dict[str, list[list[float]]]  # per score function, per prompt, per sample
    seconds: float  # generation and scoring

    def summary(self, name: str) -> ScoreSummary:
        scores = self.scores[name]
        means = [sum(prompt) / len(prompt) for prompt in scores]
        passed = None
        if is_binary(scores):
            passed = sum(pass_at_k(len(p), int(sum(p)), len(p)) for p in scores) / len(scores)
        return ScoreSummary(means, interval(means), passed)

    def record(self, step: int) -> EvalRecord:
        """What the panel keeps of the result (a `VersionScore` row per score): each score's avg@k with its 95 %
        interval and pass@k for 0/1 scores, placed by version, the optimizer step it holds, and settings key."""
        return {
            "time": time.time(),
            "version": self.version,
            "step": step,
            "key": self.key,
            "prompts": len(self.prompts),
            "k": self.k,
            "seconds": self.seconds,
            "scores": {name: summary_json(self.summary(name)) for name in self.scores},
        }

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> VersionEval:
        return cls(**json.loads(text))


def result_key(spec: RunSpec, held: HeldOut, sampling: Sampling) -> str:
    """A short hash of what a result depends on: the held-out prompts, the sampling, the rewards and metrics and the
    columns they read (a run without metrics keeps the key it had before metrics existed). The evaluator beside a run
    and the panel's after the run key alike, so each reads the other's."""
    parts = {
        # 2: scored on the completions' own token ids (before, the panel counted a token per word)
        "scoring": 2,
        "prompts": held.fingerprint,
        "sampling": sampling.describe(),
        "rewards": [reward.model_dump() for reward in spec.rewards],
        **({"metrics": [metric.model_dump() for metric in spec.eval.metrics]} if spec.eval.metrics else {}),
        "dataset": spec.dataset.model_dump(include={"prompt_column", "answer_column", "system_prompt"}),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def scored_functions(spec: RunSpec) -> list[RewardSpec]:
    """What an evaluation scores each completion with, in order: the run's rewards, then its eval metrics."""
    return [*spec.rewards, *spec.eval.metrics]


def function_fields(spec: RunSpec) -> list[str]:
    """The spec field of each of `scored_functions`, for errors: `rewards.0`, ..., `eval.metrics.0`, ..."""
    return [f"rewards.{i}" for i in range(len(spec.rewards))] + [
        f"eval.metrics.{i}" for i in range(len(spec.eval.metrics))
    ]


def score_names(spec: RunSpec) -> list[str]:
    """The score each of `scored_functions` is kept under: `rewards/<name>` (weighted, summed into the total) and
    `metrics/<name>` (reported as they are, never in the total: they are not trained on)."""
    return [f"rewards/{r.name}" for r in spec.rewards] + [f"metrics/{m.name}" for m in spec.eval.metrics]


def score_table(
    names: Sequence[str], weighted: Sequence[Sequence[float | None]], k: int
) -> dict[str, list[list[float]]]:
    """Per score, per prompt, per sample: the total, then each score named in `names` (`score_names`), from each
    function's weighted scores of the completions (prompt after prompt, k each). A None (TRL: the reward does not
    apply to that completion) or a non-finite score counts 0."""
    per_score = {
        name: [0.0 if s is None or not math.isfinite(s) else float(s) for s in scores]
        for name, scores in zip(names, weighted, strict=True)
    }
    rewards = [values for name, values in per_score.items() if name.startswith("rewards/")]
    count = len(weighted[0]) if weighted else 0
    total = [sum(values[i] for values in rewards) for i in range(count)]
    return {TOTAL: _per_prompt(total, k)} | {name: _per_prompt(values, k) for name, values in per_score.items()}


def _per_prompt(values: list[float], k: int) -> list[list[float]]:
    return [values[i : i + k] for i in range(0, len(values), k)]


def stored_result(store: ObjectStore, run_id: str, version: int, key: str) -> VersionEval | None:
    """A version's result under `key` as kept in the store, or None when it was not evaluated so."""
    try:
        return VersionEval.from_json(store.get_bytes(layout.eval_key(run_id, version, key)))
    except ObjectNotFound:
        return None


def interval_json(value: Interval) -> IntervalJson:
    """An interval as JSON can carry it (one prompt's is unbounded: None)."""
    return {"mean": value.mean, "low": _finite(value.low), "high": _finite(value.high)}


def summary_json(summary: ScoreSummary) -> EvalScore:
    """A score's avg@k with its interval and pass@k: what the API answers and the `eval` stream carries."""
    return {**interval_json(summary.avg), "pass_at_k": summary.pass_at_k}


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
