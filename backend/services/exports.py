"""A run's metrics and rollout samples as files that leave the panel: CSV for spreadsheets, Parquet for pandas,
Polars or DuckDB.

Metrics come one row per optimizer step and one column per metric, named as TRL logs them (`reward`, `kl`,
`perf/step_s`, ...), with the wall time each step was logged at; samples come one row per completion with its
scores, an agent's episode in one row with its turns in `turns`. Both are read from SQLite in one query each, so an
export reflects what the panel shows at that moment.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from sqlmodel import col, select

from backend.context import PanelContext
from backend.database.models import MetricPoint, RolloutSample
from backend.database.turns import Turn
from backend.ingestion.ingest import held_out_scores
from backend.services.runs import RunService

ExportFormat = Literal["csv", "parquet"]
FORMATS: tuple[ExportFormat, ...] = ("csv", "parquet")
SAMPLE_COLUMNS = [
    "step",
    "policy_version",
    "staleness",
    "group_id",
    "prompt",
    "completion",
    "reward",
    "advantage",
    "dropped",
    "time",
    "attempt",
]
# An episode's turns in Parquet: one type whatever the run's turns held (a column of nothing but single replies, or
# with no tool turn, would otherwise be typed null); a tool call's arguments as their JSON text.
TOOL_CALL_TYPE = pa.struct([("name", pa.string()), ("arguments", pa.string())])
TURN_TYPE = pa.struct(
    [
        ("role", pa.string()),
        ("content", pa.string()),
        ("name", pa.string()),
        ("tool_calls", pa.list_(TOOL_CALL_TYPE)),
        ("version", pa.int64()),
    ]
)
TURNS_TYPE = pa.list_(TURN_TYPE)


class ExportService:
    def __init__(self, ctx: PanelContext, owner: str):
        self.ctx, self.owner = ctx, owner
        self.runs = RunService(ctx, owner)

    def metrics(self, run_id: str) -> pd.DataFrame:
        """One row per step: `step`, `time` (when the step was logged, Unix seconds), then every metric; held-out
        scores as `eval/<score>` with their 95 % bounds (`eval/<score>/low`, `/high`) at the step of the version
        evaluated (the base model at step 0)."""
        self.runs.get(run_id)  # the owner check
        with self.ctx.db.session() as session:
            rows = session.exec(
                select(MetricPoint.step, MetricPoint.time, MetricPoint.name, MetricPoint.value).where(
                    MetricPoint.run_id == run_id
                )
            ).all()
            held_out = session.exec(held_out_scores(run_id)).all()
        # An evaluation's time is when it was scored: a step's time stays when the trainer logged it.
        evaluated = [
            (score.step, None, f"eval/{score.name}{part}", value)
            for score in held_out
            for part, value in (("", score.mean), ("/low", score.low), ("/high", score.high))
            if value is not None
        ]
        points = pd.DataFrame([*rows, *evaluated], columns=["step", "time", "name", "value"])
        if points.empty:
            return pd.DataFrame(columns=["step", "time"])
        wide = points.pivot_table(index="step", columns="name", values="value", aggfunc="last")
        wide = wide[sorted(wide.columns)]
        wide.insert(0, "time", points.groupby("step")["time"].max())
        wide.columns.name = None
        return wide.reset_index()

    def samples(self, run_id: str) -> pd.DataFrame:
        """One row per completion, in step order; each reward function's score in a `reward/<name>` column; an
        agent's episode's turns in `turns` (`exported_turns`; None for a single reply)."""
        self.runs.get(run_id)
        with self.ctx.db.session() as session:
            rows = session.exec(
                select(RolloutSample)
                .where(RolloutSample.run_id == run_id)
                .order_by(col(RolloutSample.step), col(RolloutSample.id))
            ).all()
        frame = pd.DataFrame([{name: getattr(row, name) for name in SAMPLE_COLUMNS} for row in rows])
        if frame.empty:
            return pd.DataFrame(columns=[*SAMPLE_COLUMNS, "turns"])
        frame["turns"] = [exported_turns(row.turns) for row in rows]
        scores = pd.DataFrame([row.rewards for row in rows]).add_prefix("reward/")
        return pd.concat([frame, scores], axis=1)

    def export(self, run_id: str, fmt: ExportFormat, folder: Path | None = None) -> list[Path]:
        """Write `<run>-metrics.<fmt>` and `<run>-samples.<fmt>` into `folder` (default: the panel's exports
        folder for this owner); returns both paths."""
        if fmt not in FORMATS:
            raise ValueError(f"format: {fmt!r} is not one of {', '.join(FORMATS)}")
        folder = folder or self.ctx.folder / "exports" / self.owner  # as downloads are kept
        folder.mkdir(parents=True, exist_ok=True)
        paths = []
        for kind, frame in (("metrics", self.metrics(run_id)), ("samples", self.samples(run_id))):
            path = folder / f"{run_id}-{kind}.{fmt}"
            temp = path.with_suffix(f".{fmt}.tmp")
            if fmt == "csv":
                # RFC 4180's CRLF: a field is quoted when it holds any character of the line terminator, and
                # completions hold bare carriage returns that would otherwise split a row for every reader.
                _turns_as_text(frame).to_csv(temp, index=False, lineterminator="\r\n")
            else:
                pq.write_table(_parquet_table(frame), temp)
            temp.replace(path)  # a reader never sees half a file
            paths.append(path)
        return paths


def exported_turns(turns: list[Turn] | None) -> list[dict[str, Any]] | None:
    """An episode's turns as an export holds them (None for a single reply): role, content, the tool's name, the tool
    calls and the version that generated the turn, a tool call's arguments as their JSON text (as the model wrote
    them, where they were not parsed)."""
    if turns is None:
        return None
    return [
        asdict(turn)
        | {"tool_calls": [{"name": call.name, "arguments": _json_text(call.arguments)} for call in turn.tool_calls]}
        for turn in turns
    ]


def _json_text(arguments: dict[str, Any] | str) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _turns_as_text(frame: pd.DataFrame) -> pd.DataFrame:
    """For CSV: each episode's turns as one JSON text, empty for a single reply (the metrics' frame as it is)."""
    if "turns" not in frame:
        return frame
    return frame.assign(
        turns=[json.dumps(t, ensure_ascii=False) if isinstance(t, list) else None for t in frame["turns"]]
    )


def _parquet_table(frame: pd.DataFrame) -> pa.Table:
    """For Parquet: the samples' `turns` as lists of structs of one type (TURNS_TYPE), null for a single reply, typed
    here rather than by pandas (whose metadata for such a column pandas itself cannot read back)."""
    if "turns" not in frame:
        return pa.Table.from_pandas(frame, preserve_index=False)
    table = pa.Table.from_pandas(frame.drop(columns="turns"), preserve_index=False)
    turns = pa.array([t if isinstance(t, list) else None for t in frame["turns"]], type=TURNS_TYPE)
    return table.add_column(frame.columns.get_loc("turns"), "turns", turns)
