"""A run's metrics and rollout samples as files that leave the panel: CSV for spreadsheets, Parquet for pandas,
Polars or DuckDB.

Metrics come one row per optimizer step and one column per metric, named as TRL logs them (`reward`, `kl`,
`perf/step_s`, ...), with the wall time each step was logged at; samples come one row per completion with its
scores. Both are read from SQLite in one query each, so an export reflects what the panel shows at that moment.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import pandas as pd
from sqlmodel import col, select

from backend.context import PanelContext
from backend.ingest import held_out_scores
from backend.models import MetricPoint, RolloutSample
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
        """One row per completion, in step order; each reward function's score in a `reward/<name>` column."""
        self.runs.get(run_id)
        with self.ctx.db.session() as session:
            rows = session.exec(
                select(RolloutSample)
                .where(RolloutSample.run_id == run_id)
                .order_by(col(RolloutSample.step), col(RolloutSample.id))
            ).all()
        frame = pd.DataFrame([{name: getattr(row, name) for name in SAMPLE_COLUMNS} for row in rows])
        if frame.empty:
            return pd.DataFrame(columns=SAMPLE_COLUMNS)
        scores = pd.DataFrame([json.loads(row.rewards_json or "{}") for row in rows]).add_prefix("reward/")
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
                frame.to_csv(temp, index=False, lineterminator="\r\n")
            else:
                frame.to_parquet(temp, index=False)
            temp.replace(path)  # a reader never sees half a file
            paths.append(path)
        return paths
