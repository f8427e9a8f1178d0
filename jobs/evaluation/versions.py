"""Stored versions scored on an engine of one's own, one after the other: each loaded under its own LoRA name for its
turn, sampled on the held-out prompts, scored, and kept in the bucket.

The panel does this on its machine for the embedded default (scoring in its reward sandbox), and the evaluator job on
HF Jobs for a model too large for the panel (scoring in the job, as the trainer does): one loop, two scorers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from jobs.contract import RunSpec, layout
from jobs.evaluation.engine import adapter_loaded
from jobs.evaluation.heldout import EvalPrompts
from jobs.evaluation.results import VersionEval
from jobs.evaluation.sampling import Completion, Sampling, draw
from jobs.store import ObjectStore

# Per score, per prompt, per sample (jobs/evaluation/results.py's `score_table`) of the sampled completions.
Score = Callable[[EvalPrompts, list[list[Completion]]], dict[str, list[list[float]]]]


def evaluate_versions(
    url: str,
    spec: RunSpec,
    prompts: EvalPrompts,
    sampling: Sampling,
    key: str,
    versions: list[int],
    adapter_dir: Callable[[int], Path],
    score: Score,
    store: ObjectStore,
) -> dict[int, VersionEval]:
    """Evaluate `versions` (0: the base model) on the engine at `url`, each result stored under `key` as soon as it
    is scored (a later failure keeps what was done); `adapter_dir` gives a version's adapter as a local folder."""
    results: dict[int, VersionEval] = {}
    for version in versions:
        started = time.monotonic()
        if version == 0:
            sampled = draw(prompts, url, spec.model.id, sampling)
        else:
            with adapter_loaded(url, f"eval-v{version}", adapter_dir(version)) as name:
                sampled = draw(prompts, url, name, sampling)
        result = VersionEval(
            run_id=spec.run_id,
            version=version,
            key=key,
            source=prompts.source,
            sampling=sampling.describe(),
            k=sampling.k,
            prompts=prompts.texts,
            completions=[[completion.text for completion in prompt] for prompt in sampled],
            scores=score(prompts, sampled),
            seconds=time.monotonic() - started,
        )
        store.put_bytes(layout.eval_key(spec.run_id, version, key), result.to_json().encode())
        results[version] = result
    return results
