"""From a spec's dataset section to the conversational prompts TRL's AsyncGRPOTrainer needs.

TRL needs a `prompt` column of chat messages: plain-string prompts crash its rollout child and the trainer then
hangs. Prompts longer than the model can take alongside a full completion are dropped here, because vLLM answers such
a request with 400 and TRL retries it ~90 times before its rollout worker dies.

The panel uses the same functions to preview a dataset and check its columns before anything is launched.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobs.contract import DatasetSpec
from jobs.store import ObjectNotFound, ObjectStore

if TYPE_CHECKING:
    from datasets import Dataset

log = logging.getLogger(__name__)
ANSWER = "answer"  # rewards receive the gold answer under this name, whatever the dataset calls it
NO_ROWS = "point at a file or split with at least one row"
# A row's tools (jobs/environments/loading.py's `row_tools`): their schemas are rendered into its prompt.
Tools = list[Callable[..., Any]]


class DatasetError(ValueError):
    """The dataset cannot be used as specified; the message names the field and what to do."""


def load_rows(spec: DatasetSpec, store: ObjectStore | None = None, limit: int | None = None) -> Dataset:
    """The raw rows as a `datasets.Dataset` (at most `limit`, or the spec's own limit)."""
    import datasets

    limit = min(filter(None, (limit, spec.limit)), default=None)
    if spec.source == "builtin":
        from jobs.demo.dataset import builtin_rows, builtin_splits

        splits = builtin_splits(spec.id)
        if spec.split not in splits:
            raise DatasetError(
                f"dataset.split: the built-in dataset has no split {spec.split!r}; use {' or '.join(splits)}"
            )
        rows = datasets.Dataset.from_list(builtin_rows(spec.id, spec.split))
    elif spec.source == "store":
        rows = _load_store_file(spec, store)
    else:
        split = f"{spec.split}[:{limit}]" if limit else spec.split
        try:
            rows = datasets.load_dataset(spec.id, split=split)
        except ValueError as error:
            if "split" in str(error).lower() or "Unknown split" in str(error):
                raise DatasetError(f"dataset.split: {spec.id} has no split {spec.split!r} ({error})") from None
            raise DatasetError(f"dataset.id: could not load {spec.id!r}: {error}") from None
        except FileNotFoundError:
            raise DatasetError(f"dataset.id: {spec.id!r} was not found on the Hub; check the id") from None
        except Exception as error:  # network, auth, gated: say so without a traceback
            raise DatasetError(
                f"dataset.id: could not load {spec.id!r} ({type(error).__name__}: {str(error)[:200]})"
            ) from None
    if limit is not None and len(rows) > limit:
        rows = rows.select(range(limit))
    if len(rows) == 0:
        raise DatasetError(f"dataset.id: {spec.id!r} ({spec.split}) has no rows; {NO_ROWS}")
    return rows


def _load_store_file(spec: DatasetSpec, store: ObjectStore | None) -> Dataset:
    import datasets

    if store is None:
        raise DatasetError("dataset.source: a dataset in the store needs the run's store")
    suffix = Path(spec.id).suffix
    builder = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}[suffix]
    with tempfile.TemporaryDirectory() as folder:
        local = Path(folder) / f"data{suffix}"
        try:
            store.get_file(spec.id, local)
        except ObjectNotFound:
            raise DatasetError(f"dataset.id: {spec.id!r} is not in {store.describe()}; upload it first") from None
        try:
            return datasets.load_dataset(builder, data_files=str(local), split="train", keep_in_memory=True)
        except Exception as error:
            # An empty file, or a CSV with only its header: `datasets` finds no data rather than zero rows.
            if local.stat().st_size == 0 or "corresponds to no data" in str(error):
                raise DatasetError(f"dataset.id: {spec.id!r} has no rows; {NO_ROWS}") from None
            raise DatasetError(f"dataset.id: {spec.id!r} could not be parsed as {builder}: {error}") from None


def check_columns(rows: Dataset, spec: DatasetSpec) -> None:
    """Raise DatasetError naming a missing prompt or answer column and the columns (or fields) that do exist.

    The answer column may be a dotted path into a struct column (`reward_model.ground_truth`), as many public RL
    datasets keep their gold answer.
    """
    columns = list(rows.column_names)
    for field, column in (("prompt_column", spec.prompt_column), ("answer_column", spec.answer_column)):
        if column is None:
            continue
        top, *inner = column.split(".")
        if top not in columns:
            raise DatasetError(
                f"dataset.{field}: column {top!r} is not in the dataset; its columns are {', '.join(columns)}"
            )
        value = rows[0][top]
        for depth, key in enumerate(inner):
            if not isinstance(value, dict) or key not in value:
                path = ".".join([top, *inner[:depth]])
                fields = ", ".join(value) if isinstance(value, dict) else "none: it is not a struct"
                raise DatasetError(f"dataset.{field}: {path!r} has no field {key!r}; its fields are {fields}")
            value = value[key]


def column_value(row: dict[str, Any], path: str) -> Any:
    """The value at a column name or a dotted path into struct columns."""
    value = row
    for key in path.split("."):
        value = value[key]
    return value


def to_messages(prompt: Any, system_prompt: str | None) -> list[dict[str, str]]:
    """One prompt as chat messages: strings become a user turn; message lists pass through (validated)."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt):
        messages = [{"role": str(m["role"]), "content": str(m.get("content") or "")} for m in prompt]
    else:
        raise DatasetError(
            "dataset.prompt_column: each prompt must be a string or a list of {role, content} messages, "
            f"got {type(prompt).__name__}"
        )
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def prompt_token_ids(tokenizer: Any, messages: list[dict[str, str]], tools: Tools | None = None) -> list[int]:
    """The token ids TRL sends for `messages`: the chat template with the generation prompt appended, and the tools'
    schemas where the model may call tools."""
    offered = {"tools": tools} if tools else {}  # a run without tools renders exactly as it always did
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **offered)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def build_prompts(
    spec: DatasetSpec,
    rows: Dataset,
    tokenizer: Any = None,
    max_prompt_tokens: int | None = None,
    tools_for: Callable[[dict[str, Any]], Tools] | None = None,
) -> Dataset:
    """The dataset TRL trains on: `prompt` (messages) and `answer` (the gold answer as text), plus every column of the
    dataset under its own name — structs and lists included — as TRL hands them to reward functions.

    With a tokenizer and `max_prompt_tokens`, prompts that would leave no room for a full completion are dropped,
    counted with the schemas of the tools the model may call on each row (`tools_for(row)`: TRL renders them into
    the row's prompt).
    """
    import datasets

    check_columns(rows, spec)
    own = [name for name in rows.column_names if name not in ("prompt", ANSWER)]
    records: list[dict[str, Any]] = []
    dropped = 0
    for row in rows:
        messages = to_messages(row[spec.prompt_column], spec.system_prompt)
        tools = tools_for(row) if tools_for is not None else None
        if (
            tokenizer is not None
            and max_prompt_tokens is not None
            and len(prompt_token_ids(tokenizer, messages, tools)) > max_prompt_tokens
        ):
            dropped += 1
            continue
        answer = "" if spec.answer_column is None else str(column_value(row, spec.answer_column))
        record: dict[str, Any] = {"prompt": messages, ANSWER: answer}
        record.update({name: row[name] for name in own})
        records.append(record)
    if dropped:
        log.warning(
            "dropped %d prompts longer than %d tokens (no room left for a completion)", dropped, max_prompt_tokens
        )
    if not records:
        schemas = " with the tools' schemas" if tools_for is not None else ""
        raise DatasetError(
            f"dataset: every prompt{schemas} is longer than {max_prompt_tokens} tokens; raise model.max_model_len or "
            "lower grpo.max_completion_length"
        )
    return datasets.Dataset.from_list(records)
