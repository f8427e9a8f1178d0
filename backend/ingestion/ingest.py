"""Turning telemetry records from the store into SQLite rows, in bulk.

One function per stream; each takes the records of one chunk and inserts them with a single executemany, inside the
caller's transaction (the poller commits the rows and its cursor together, which is what makes ingestion exactly
once). Each takes its records as decoded from the job's JSON, and gives them their stream's shape
(backend/ingestion/records.py) where it reads them: what a job sends may hold anything, so every field is still
checked or coerced here.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar, cast

from sqlalchemy import ScalarSelect, delete, func, insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlmodel import Session, SQLModel, col, select
from sqlmodel.sql.expression import SelectOfScalar

from backend.database.models import (
    VERSION_REWARD_STEPS,
    Event,
    MetricPoint,
    ProxySnapshot,
    ResumePoint,
    RolloutSample,
    VersionScore,
)
from backend.ingestion.episodes import stored_turns
from backend.ingestion.records import (
    EvalColumns,
    EvalRow,
    EventRecord,
    JsonRecord,
    MetricRecord,
    MetricRow,
    SampleRecord,
    SampleRow,
)

if TYPE_CHECKING:  # the shapes of records as their jobs write them
    from jobs.evaluation.results import EvalRecord, EvalScore
    from jobs.proxy import stats as proxy_stats  # its `ProxySnapshot`, beside the table of that name

# Columns every metric record carries that are not metrics.
_RECORD_FIELDS = {"step", "time", "attempt"}


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def metric_rows(run_id: str, owner: str, records: Sequence[JsonRecord]) -> list[MetricRow]:
    rows: list[MetricRow] = []
    for record in cast("Sequence[MetricRecord]", records):
        step, when, attempt = int(record.get("step", 0)), record.get("time"), int(record.get("attempt", 1))
        for name, value in record.items():
            number = _number(value)
            if name not in _RECORD_FIELDS and number is not None:
                rows.append(
                    {
                        "run_id": run_id,
                        "owner": owner,
                        "step": step,
                        "name": name,
                        "value": number,
                        "time": when,
                        "attempt": attempt,
                    }
                )
    return rows


def sample_rows(run_id: str, owner: str, records: Sequence[JsonRecord]) -> list[SampleRow]:
    """One row per sample; an agent's episode keeps its `turns` too, checked and cut to size
    (backend/ingestion/episodes.py)."""
    return [
        {
            "run_id": run_id,
            "owner": owner,
            "step": int(record.get("step", 0)),
            "policy_version": int(record.get("policy_version", 0)),
            "staleness": int(record.get("staleness", 0)),
            "group_id": int(record.get("group_id", 0)),
            "prompt": str(record.get("prompt", "")),
            "completion": str(record.get("completion", "")),
            "reward": _number(record.get("reward")),
            "rewards_json": json.dumps(record.get("rewards") or {}),
            "advantage": _number(record.get("advantage")) or 0.0,
            "dropped": bool(record.get("dropped", False)),
            "time": record.get("time"),
            "attempt": int(record.get("attempt", 1)),
            "turns_json": stored_turns(record.get("turns")),
        }
        for record in cast("Sequence[SampleRecord]", records)
    ]


def _whole(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def eval_rows(run_id: str, owner: str, records: Sequence[JsonRecord]) -> list[EvalRow]:
    """One row per (record, score name). A record without a version, step or settings key, and a score without a
    finite mean, are left out (nothing could place them); a bound that is not finite is None, an unbounded interval."""
    rows: list[EvalRow] = []
    for record in cast("Sequence[EvalRecord]", records):
        shared = _version_columns(run_id, owner, record)
        scores = record.get("scores")
        if shared is None or not isinstance(scores, dict):
            continue
        for name, score in scores.items():
            values: EvalScore = score if isinstance(score, dict) else {}
            mean = _number(values.get("mean"))
            if mean is not None:
                rows.append(
                    {
                        **shared,
                        "name": str(name),
                        "mean": mean,
                        "low": _number(values.get("low")),
                        "high": _number(values.get("high")),
                        "pass_at_k": _number(values.get("pass_at_k")),
                    }
                )
    return rows


def _version_columns(run_id: str, owner: str, record: EvalRecord) -> EvalColumns | None:
    """The columns an eval record's scores share, or None when it does not say which version under which settings."""
    version, step, key = _whole(record.get("version")), _whole(record.get("step")), record.get("key")
    if version is None or step is None or not isinstance(key, str) or not key:
        return None
    return {
        "run_id": run_id,
        "owner": owner,
        "version": version,
        "step": step,
        "key": key,
        "prompts": _whole(record.get("prompts")) or 0,
        "k": _whole(record.get("k")) or 0,
        "time": _number(record.get("time")) or time.time(),
    }


def _bulk_insert(session: Session, table: type[SQLModel], rows: Sequence[Mapping[str, object]]) -> int:
    """One executemany straight on the driver: the ORM's per-row bookkeeping costs more than SQLite's insert."""
    if rows:
        columns = list(rows[0])
        statement = f"INSERT INTO {table.__tablename__} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"
        session.connection().exec_driver_sql(statement, [tuple(row[c] for c in columns) for row in rows])
    return len(rows)


def ingest_metrics(session: Session, run_id: str, owner: str, records: Sequence[JsonRecord]) -> int:
    return _bulk_insert(session, MetricPoint, _not_superseded(session, run_id, metric_rows(run_id, owner, records)))


def ingest_samples(session: Session, run_id: str, owner: str, records: Sequence[JsonRecord]) -> int:
    return _bulk_insert(session, RolloutSample, _not_superseded(session, run_id, sample_rows(run_id, owner, records)))


def ingest_eval(session: Session, run_id: str, owner: str, records: Sequence[JsonRecord]) -> int:
    """A version's scores under one settings key are written once: a resumed trainer or a second evaluator that scores
    it again adds nothing. Nothing is superseded on resume: a resumed trainer never reuses a version number."""
    rows = eval_rows(run_id, owner, records)
    if rows:
        session.execute(sqlite_insert(VersionScore).on_conflict_do_nothing(), rows)
    return len(rows)


def ingest_events(session: Session, run_id: str, owner: str, records: Sequence[JsonRecord]) -> int:
    events = cast("Sequence[EventRecord]", records)
    for record in events:
        if record.get("kind") == "resume" and record.get("resumed_from_step") is not None:
            supersede(session, run_id, int(record["resumed_from_step"]), int(record.get("attempt", 1)))
    rows = [
        {
            "run_id": run_id,
            "owner": owner,
            "time": float(record.get("time") or time.time()),
            "level": str(record.get("level", "info")),
            "kind": str(record.get("kind", "event")),
            "message": str(record.get("message", ""))[:4000],
            # Errors and failed audits stay active until someone (or a later success) clears them.
            "active": str(record.get("level")) == "error",
        }
        for record in events
    ]
    if rows:
        session.execute(insert(Event), rows)
    return len(rows)


def ingest_proxy(session: Session, run_id: str, owner: str, snapshot: JsonRecord) -> int:
    record = cast("proxy_stats.ProxySnapshot", snapshot)
    session.execute(
        insert(ProxySnapshot),
        [
            {
                "run_id": run_id,
                "owner": owner,
                "time": float(record.get("time") or time.time()),
                "stats_json": json.dumps(snapshot),
            }
        ],
    )
    return 1


def latest_proxy_snapshots(session: Session, run_id: str, limit: int = 1) -> list[proxy_stats.ProxySnapshot]:
    """The proxy's newest snapshots, oldest first, in the order they were ingested.

    Ingestion follows the chunks' sequence numbers, which is the order the proxies wrote them; the times inside come
    from whichever machine wrote them, and a relaunched trainer's clock may run behind the dead one's.
    """
    rows = session.exec(
        select(ProxySnapshot.stats_json)
        .where(ProxySnapshot.run_id == run_id)
        .order_by(col(ProxySnapshot.id).desc())
        .limit(limit)
    ).all()
    return cast("list[proxy_stats.ProxySnapshot]", [json.loads(row) for row in reversed(rows)])  # as they came


def latest_proxy_snapshot(session: Session, run_id: str) -> proxy_stats.ProxySnapshot | None:
    """The proxy's newest snapshot (`latest_proxy_snapshots`), or None before the first."""
    latest = latest_proxy_snapshots(session, run_id)
    return latest[0] if latest else None


def supersede(session: Session, run_id: str, resumed_from_step: int, attempt: int) -> None:
    """Drop what earlier attempts logged after the checkpoint a later attempt resumed from: those steps are redone.

    The resume point is kept, so records of the earlier attempts that are ingested later (the rest of a backlog read
    in several passes, or a dying attempt's last chunks) are dropped on arrival by `_not_superseded`.
    """
    session.execute(
        sqlite_insert(ResumePoint)
        .values(run_id=run_id, attempt=attempt, resumed_from_step=resumed_from_step)
        .on_conflict_do_nothing()
    )
    for table in (MetricPoint, RolloutSample):
        session.execute(
            delete(table).where(
                col(table.run_id) == run_id, col(table.step) > resumed_from_step, col(table.attempt) < attempt
            )
        )


_Row = TypeVar("_Row", MetricRow, SampleRow)  # the rows of a step, which a resumed attempt may redo


def _not_superseded(session: Session, run_id: str, rows: list[_Row]) -> list[_Row]:
    """`rows` without those a later attempt redid: logged by an attempt before it, past the step it resumed from."""
    points = session.exec(
        select(ResumePoint.attempt, ResumePoint.resumed_from_step).where(ResumePoint.run_id == run_id)
    ).all()
    if not points:
        return rows
    return [row for row in rows if not any(row["attempt"] < attempt and row["step"] > step for attempt, step in points)]


def version_reward(session: Session, run_id: str, step: int | None) -> float | None:
    """The mean reward over the `VERSION_REWARD_STEPS` steps up to `step`: what the version list shows (labelled
    as a mean) and what picks the best version."""
    if step is None:
        return None
    return session.exec(
        select(func.avg(MetricPoint.value)).where(
            MetricPoint.run_id == run_id,
            MetricPoint.name == "reward",
            MetricPoint.step > step - VERSION_REWARD_STEPS,
            MetricPoint.step <= step,
        )
    ).first()


def _in_run_key(run_id: str) -> ScalarSelect[str]:
    """The settings key of the run's own evaluation: that of the newest score ingested (after-run evaluations with
    other settings have other keys, and their scores are not comparable with these)."""
    newest = select(VersionScore.key).where(VersionScore.run_id == run_id).order_by(col(VersionScore.id).desc())
    return newest.limit(1).scalar_subquery()


def held_out_scores(run_id: str, name: str | None = None) -> SelectOfScalar[VersionScore]:
    """The run's scores under its own evaluation's settings: those named `name`, one per version, or all of them."""
    query = select(VersionScore).where(VersionScore.run_id == run_id, VersionScore.key == _in_run_key(run_id))
    return query if name is None else query.where(VersionScore.name == name)


def best_held_out(session: Session, run_id: str, adapters_only: bool = False) -> VersionScore | None:
    """The version with the highest held-out reward, the earlier one of a tie (it cost fewer steps); with
    `adapters_only`, the base model (v0) left out."""
    query = held_out_scores(run_id, "reward")
    if adapters_only:
        query = query.where(VersionScore.version > 0)
    return session.exec(query.order_by(col(VersionScore.mean).desc(), col(VersionScore.version)).limit(1)).first()
