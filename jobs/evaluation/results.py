"""One version's evaluation as it is kept in the store: every completion, every score, and their summaries.

A result is keyed by what it depends on (the held-out prompts, the sampling, the score functions), so asking for the
same evaluation again reads it back and changing any of them evaluates again.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from jobs.evaluation.statistics import Interval, interval, is_binary, pass_at_k


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

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> VersionEval:
        return cls(**json.loads(text))


def result_key(parts: dict[str, Any]) -> str:
    """A short hash of what a result depends on."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
