"""Which prompts a run is evaluated on, and which of its rows the trainer must never see.

Held-out prompts come from another split of the run's dataset, or from rows carved off the training split with the
eval seed. Whatever the source, a prompt that also occurs among the training prompts (compared with whitespace
collapsed) is dropped and counted: a score on prompts the policy trained on says nothing about prompts it did not.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jobs.contract import EvalSpec, RunSpec
from jobs.store import ObjectStore
from jobs.trainer.dataset import DatasetError, build_prompts, check_columns, load_rows, prompt_token_ids

if TYPE_CHECKING:
    from jobs.evaluation.episodes import Agent  # which imports this module, through sampling


@dataclass(frozen=True)
class HeldOut:
    """The held-out rows (raw dataset rows, at most `eval.prompts`), and how they were found."""

    rows: list[dict[str, Any]]
    candidates: int  # held-out rows before the shared prompts were dropped
    shared: int  # dropped: their prompt is also a training prompt
    source: str  # in words: "split 'test'", "32 rows carved off 'train'"

    @property
    def fingerprint(self) -> str:
        """What the scores depend on among the prompts: part of every cached result's key."""
        return hashlib.sha256(json.dumps(self.rows, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class EvalPrompts:
    """The held-out prompts as they are sent and scored: the rows as the trainer builds them (prompt messages, answer,
    every column), each prompt's token ids (a single-turn run's, sent as they are; an agent's episodes render their
    own, with the tools), and each prompt's last message for people to read."""

    records: list[dict[str, Any]]
    token_ids: list[list[int]]  # empty for an agent
    texts: list[str]
    source: str
    agent: Agent | None = None  # for a run with tools: its prompts start episodes


def eval_prompts(spec: RunSpec, held: HeldOut, tokenizer: Any, eos_token_ids: list[int]) -> EvalPrompts:
    """`held`'s rows as prompts for `spec`'s model, by its chat template as the trainer renders them; an agent's
    turns end at `eos_token_ids` (`jobs.models.eos_token_ids`, which the caller's rewards are built with too)."""
    from datasets import Dataset

    records = [dict(row) for row in build_prompts(spec.dataset, Dataset.from_list(held.rows))]
    texts = [str(record["prompt"][-1]["content"]) for record in records]
    if not spec.environment.enabled:
        token_ids = [prompt_token_ids(tokenizer, record["prompt"]) for record in records]
        return EvalPrompts(records, token_ids, texts, held.source)
    from jobs.environments.loading import check_environment_column
    from jobs.evaluation.episodes import agent_for

    agent = agent_for(spec, tokenizer, eos_token_ids)
    check_environment_column(agent.environment, records)  # held-out rows name their environments as training's do
    return EvalPrompts(records, [], texts, held.source, agent)


def normalise(prompt: Any) -> str:
    """A prompt's text with whitespace collapsed; chat messages as `role: content` lines."""
    if isinstance(prompt, list):
        text = "\n".join(f"{m.get('role')}: {m.get('content')}" for m in prompt if isinstance(m, dict))
    else:
        text = str(prompt)
    return " ".join(text.split())


def carve(row_count: int, holdout: int, seed: int) -> tuple[list[int], list[int]]:
    """(training indices, held-out indices): `holdout` rows drawn with `seed`; both lists in the dataset's order."""
    if holdout >= row_count:
        raise DatasetError(
            f"eval.holdout: {holdout} held-out rows would leave none of the {row_count} to train on; carve fewer"
        )
    held = sorted(random.Random(seed).sample(range(row_count), holdout))
    kept = set(held)
    return [index for index in range(row_count) if index not in kept], held


def training_rows(rows: Any, spec: EvalSpec) -> Any:
    """The rows the trainer may see (a `datasets.Dataset`): all of them, less the carved held-out rows."""
    if spec.holdout is None:
        return rows
    train, _ = carve(len(rows), spec.holdout, spec.seed)
    return rows.select(train)


def held_out(spec: RunSpec, store: ObjectStore | None = None) -> HeldOut:
    """The held-out rows of `spec`'s evaluation; DatasetError naming the eval field when there are none to use."""
    settings, column = spec.eval, spec.dataset.prompt_column
    if not settings.enabled:
        raise DatasetError("eval.split: this run has no held-out prompts; name a held-out split or carve rows")
    training = load_rows(spec.dataset, store)
    if settings.holdout is not None:
        train, held = carve(len(training), settings.holdout, settings.seed)
        candidates, training = training.select(held), training.select(train)
        source, field = f"{settings.holdout} rows carved off {spec.dataset.split!r}", "eval.holdout"
    else:
        source, field = f"split {settings.split!r}", "eval.split"
        candidates = _other_split(spec, store)
    seen = {normalise(row[column]) for row in training}
    kept = [dict(row) for row in candidates if normalise(row[column]) not in seen]
    shared = len(candidates) - len(kept)
    if not kept:
        raise DatasetError(
            f"{field}: all {len(candidates)} held-out prompts of {source} also occur in the training rows; "
            "evaluate on prompts the run does not train on"
        )
    if len(kept) > settings.prompts:
        chosen = sorted(random.Random(settings.seed).sample(range(len(kept)), settings.prompts))
        kept = [kept[index] for index in chosen]
    return HeldOut(kept, len(candidates), shared, source)


def _other_split(spec: RunSpec, store: ObjectStore | None) -> Any:
    """The rows of the held-out split, its errors named after `eval.split`."""
    dataset = spec.dataset.model_copy(update={"split": spec.eval.split, "limit": None})
    try:
        rows = load_rows(dataset, store)
        check_columns(rows, dataset)
    except DatasetError as error:
        field, _, message = str(error).partition(": ")
        raise DatasetError(f"eval.split: in split {spec.eval.split!r}, {message or field}") from None
    return rows
