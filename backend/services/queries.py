"""Read-only queries the UI and the CLI make: metric series, samples, router stats, job cards, summaries.

All of them take the owner and only return that owner's data.
"""

from __future__ import annotations

import json
import statistics
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy
from sqlalchemy import func, or_
from sqlmodel import col, select

from backend.context import PanelContext
from backend.ingest import best_held_out, held_out_scores, latest_proxy_snapshots
from backend.models import AdapterVersion, Event, Job, MetricPoint, ReplicaStatus, RolloutSample, Run, VersionScore

# A count of dropped samples: summed as a Boolean column, SQLAlchemy reads any total back as True.
_DROPPED = sqlalchemy.cast(col(RolloutSample.dropped), sqlalchemy.Integer)


@dataclass(frozen=True)
class VersionUse:
    """How many of a step's samples one adapter version generated (and how many were dropped as too stale)."""

    step: int
    policy_version: int
    samples: int
    dropped: int
    trainer_version: int  # the trainer's own version when it pulled them (policy_version + staleness)


@dataclass(frozen=True)
class SampleFilters:
    """Which samples a listing holds; None does not filter."""

    step_from: int | None = None
    step_to: int | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    text: str | None = None
    version: int | None = None

    def apply(self, query: Any, run_id: str) -> Any:
        query = query.where(RolloutSample.run_id == run_id)
        if self.text:
            escaped = self.text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            pattern = f"%{escaped}%"
            query = query.where(
                or_(
                    col(RolloutSample.prompt).like(pattern, escape="\\"),
                    col(RolloutSample.completion).like(pattern, escape="\\"),
                )
            )
        if self.version is not None:
            query = query.where(RolloutSample.policy_version == self.version)
        if self.step_from is not None:
            query = query.where(RolloutSample.step >= self.step_from)
        if self.step_to is not None:
            query = query.where(RolloutSample.step <= self.step_to)
        if self.min_reward is not None:
            query = query.where(col(RolloutSample.reward) >= self.min_reward)
        if self.max_reward is not None:
            query = query.where(col(RolloutSample.reward) <= self.max_reward)
        return query


@dataclass(frozen=True)
class SampleUse:
    """Of the samples the trainer took from the replicas, how many it trained on; the rest were too stale."""

    pulled: int
    trained: int

    @property
    def trained_share(self) -> float | None:
        return self.trained / self.pulled if self.pulled else None


@dataclass(frozen=True)
class HeldOutScore:
    """One version's held-out score: the mean over the evaluation's prompts and its 95 % interval (a bound of None:
    unbounded, as with a single prompt)."""

    version: int
    step: int
    mean: float
    low: float | None
    high: float | None

    @property
    def half_width(self) -> float | None:
        return None if self.low is None or self.high is None else (self.high - self.low) / 2


def _held_out(row: VersionScore) -> HeldOutScore:
    return HeldOutScore(row.version, row.step, row.mean, row.low, row.high)


JOB_LOG_LINES = 20_000  # a job's log as the panel shows it: the newest lines, up to this many (the download has all)


@dataclass(frozen=True)
class JobLog:
    """A job's whole log (at `path`) and the part of it the panel shows: the newest lines holding `search`."""

    path: Path
    total: int  # lines in the whole log
    matching: int  # of them, those holding `search` (all, without one)
    shown: list[str]
    search: str = ""

    @property
    def left_out(self) -> int:
        """Matching lines older than those shown: only in the download."""
        return self.matching - len(self.shown)


class QueryService:
    def __init__(self, ctx: PanelContext, owner: str):
        self.ctx, self.owner = ctx, owner

    def _check(self, run_id: str) -> Run:
        from backend.services.runs import RunService

        return RunService(self.ctx, self.owner).get(run_id)  # one owner check for every service

    def metric_names(self, run_id: str) -> list[str]:
        self._check(run_id)
        with self.ctx.db.session() as session:
            return list(session.exec(select(MetricPoint.name).where(MetricPoint.run_id == run_id).distinct()).all())

    def metric_series(self, run_id: str, name: str, max_points: int | None = 2000) -> list[tuple[int, float]]:
        """(step, value) pairs in step order; long series are thinned to about `max_points` evenly spaced points."""
        self._check(run_id)
        with self.ctx.db.session() as session:
            count = session.exec(
                select(func.count()).where(MetricPoint.run_id == run_id, MetricPoint.name == name)
            ).one()
            query = select(MetricPoint.step, MetricPoint.value).where(
                MetricPoint.run_id == run_id, MetricPoint.name == name
            )
            if max_points and count > max_points:
                stride = -(-count // max_points)
                # Thin in SQL: keep every stride-th step, so a 100k-point series costs one index range scan.
                query = query.where(MetricPoint.step % stride == 0)
            rows = session.exec(query.order_by(col(MetricPoint.step))).all()
        return [(int(step), float(value)) for step, value in rows]

    def step_axis(self, run_id: str, axis: str) -> dict[int, float]:
        """What each optimizer step is at on another x axis: "wall time" (seconds since the first step was logged)
        or "generated tokens" (completion tokens generated up to and including the step: its samples times their
        mean length, summed)."""
        if axis == "wall time":
            self._check(run_id)
            with self.ctx.db.session() as session:
                rows = session.exec(
                    select(MetricPoint.step, MetricPoint.time).where(
                        MetricPoint.run_id == run_id, MetricPoint.name == "reward"
                    )
                ).all()
            times = {int(step): float(time) for step, time in rows if time is not None}
            first = min(times.values(), default=0.0)
            return {step: time - first for step, time in times.items()}
        if axis == "generated tokens":
            lengths = dict(self.metric_series(run_id, "completions/mean_length", max_points=None))
            samples = dict(self.metric_series(run_id, "batch/samples_per_step", max_points=None))
            total, axis_values = 0.0, {}
            for step in sorted(lengths.keys() & samples.keys()):
                total += lengths[step] * samples[step]
                axis_values[step] = total
            return axis_values
        raise ValueError(f"x axis: {axis!r} is not one of step, wall time, generated tokens")

    def sample_versions(self, run_id: str, max_steps: int = 400) -> list[VersionUse]:
        """Per step and generating version, over the last `max_steps` steps with samples: one GROUP BY, not rows."""
        self._check(run_id)
        with self.ctx.db.session() as session:
            last = session.exec(select(func.max(RolloutSample.step)).where(RolloutSample.run_id == run_id)).first()
            if last is None:
                return []
            step, version = col(RolloutSample.step), col(RolloutSample.policy_version)
            rows = session.execute(  # five columns: more than sqlmodel's select is typed for
                sqlalchemy.select(
                    step,
                    version,
                    func.count(),
                    func.sum(_DROPPED),
                    func.max(version + col(RolloutSample.staleness)),
                )
                .where(col(RolloutSample.run_id) == run_id, step > last - max_steps)
                .group_by(step, version)
                .order_by(step, version)
            ).all()
        return [VersionUse(int(s), int(v), int(n), int(d or 0), int(t)) for s, v, n, d, t in rows]

    def sample_use(self, run_id: str) -> SampleUse:
        """How much of the replicas' work the trainer used: the samples it pulled and those it did not drop."""
        self._check(run_id)
        with self.ctx.db.session() as session:
            pulled, dropped = session.exec(
                select(func.count(), func.sum(_DROPPED)).where(RolloutSample.run_id == run_id)
            ).one()
        return SampleUse(int(pulled), int(pulled) - int(dropped or 0))

    def sample_steps(self, run_id: str) -> tuple[int, int] | None:
        """The first and last step that have rollout samples (for the sample browser's step slider)."""
        self._check(run_id)
        with self.ctx.db.session() as session:
            low, high = session.exec(
                select(func.min(RolloutSample.step), func.max(RolloutSample.step)).where(RolloutSample.run_id == run_id)
            ).one()
        return None if low is None else (int(low), int(high))

    def step_seconds(self, run_id: str, steps: int = 20) -> float | None:
        """Seconds per optimizer step at the run's own pace: the median of its last `steps` timed steps, the first
        left out (it waits for the rollout worker to start: a demo's step 1 alone promised 42 minutes for a run that
        ended 2.5 minutes later). None until two steps after the first are timed."""
        recent = self.recent_values(run_id, "perf/step_s", steps, after_step=1)
        return statistics.median(recent) if len(recent) >= 2 else None

    def recent_values(self, run_id: str, name: str, count: int = 20, after_step: int = 0) -> list[float]:
        """The last `count` values of one metric past `after_step`, newest first (an index range scan, however long
        the run)."""
        self._check(run_id)
        with self.ctx.db.session() as session:
            return list(
                session.exec(
                    select(MetricPoint.value)
                    .where(MetricPoint.run_id == run_id, MetricPoint.name == name, MetricPoint.step > after_step)
                    .order_by(col(MetricPoint.step).desc())
                    .limit(count)
                ).all()
            )

    def samples(
        self,
        run_id: str,
        step_from: int | None = None,
        step_to: int | None = None,
        min_reward: float | None = None,
        max_reward: float | None = None,
        limit: int = 50,
        offset: int = 0,
        text: str | None = None,
        version: int | None = None,
    ) -> list[RolloutSample]:
        """Samples newest step first; in a step, those trained on before those dropped as too stale, each group
        together, best first. `text` matches prompts and completions (case-insensitive for ASCII, taken literally:
        `%` and `_` are no wildcards), `version` the adapter version that generated them."""
        self._check(run_id)
        filters = SampleFilters(step_from, step_to, min_reward, max_reward, text, version)
        query = filters.apply(select(RolloutSample), run_id).order_by(
            col(RolloutSample.step).desc(),
            col(RolloutSample.dropped),
            col(RolloutSample.group_id),
            col(RolloutSample.reward).desc(),  # SQLite puts a missing reward last here
            col(RolloutSample.id),
        )
        with self.ctx.db.session() as session:
            return list(session.exec(query.offset(offset).limit(limit)).all())

    def count_samples(self, run_id: str, filters: SampleFilters) -> int:
        """How many samples `samples` pages through with the same filters."""
        self._check(run_id)
        with self.ctx.db.session() as session:
            return int(session.exec(filters.apply(select(func.count()).select_from(RolloutSample), run_id)).one())

    def group(self, run_id: str, step: int, group_id: int) -> list[RolloutSample]:
        """Every sample of one group at one step, best first."""
        self._check(run_id)
        with self.ctx.db.session() as session:
            rows = session.exec(
                select(RolloutSample).where(
                    RolloutSample.run_id == run_id, RolloutSample.step == step, RolloutSample.group_id == group_id
                )
            ).all()
        return sorted(rows, key=lambda s: -(s.reward if s.reward is not None else float("-inf")))

    def proxy_snapshots(self, run_id: str, limit: int = 500) -> list[dict[str, Any]]:
        self._check(run_id)
        with self.ctx.db.session() as session:
            return latest_proxy_snapshots(session, run_id, limit)

    def job_log(self, run_id: str, job_id: int, into: Path, search: str = "", lines: int = JOB_LOG_LINES) -> JobLog:
        """One of the run's jobs' whole log, read from its launcher now and written to `into`; of it, the newest
        `lines` lines holding `search` (any, without one) to show."""
        run = self._check(run_id)
        with self.ctx.db.session() as session:
            job = session.get(Job, job_id)
        if job is None or job.run_id != run_id:
            raise LookupError(f"run {run_id} has no job {job_id}")
        partial = into.with_name(f"{into.name}.part")  # `into` is only ever a whole log: it may be served meanwhile
        self.ctx.launcher_for(run).write_log(self.ctx.handle(job), partial)
        partial.replace(into)
        search = search.strip()
        wanted, total, matching = search.lower(), 0, 0
        shown: deque[str] = deque(maxlen=lines)
        with into.open(encoding="utf-8", errors="replace") as log:
            for line in log:
                total += 1
                if wanted in line.lower():
                    matching += 1
                    shown.append(line.rstrip("\n"))
        return JobLog(into, total, matching, list(shown), search)

    def jobs(self, run_id: str) -> list[Job]:
        self._check(run_id)
        with self.ctx.db.session() as session:
            query = select(Job).where(Job.run_id == run_id).order_by(col(Job.role), col(Job.attempt))
            return list(session.exec(query).all())

    def heartbeats(self, run_id: str) -> dict[str, dict[str, Any]]:
        self._check(run_id)
        with self.ctx.db.session() as session:
            rows = session.exec(select(ReplicaStatus).where(ReplicaStatus.run_id == run_id)).all()
        return {row.role: json.loads(row.data_json) for row in rows}

    def versions(self, run_id: str) -> list[AdapterVersion]:
        self._check(run_id)
        with self.ctx.db.session() as session:
            return list(
                session.exec(
                    select(AdapterVersion).where(AdapterVersion.run_id == run_id).order_by(col(AdapterVersion.version))
                ).all()
            )

    def held_out_series(self, run_id: str, name: str = "reward") -> list[HeldOutScore]:
        """The run's held-out score `name` (reward, rewards/<reward name> or metrics/<metric name>) of each evaluated
        version, in version order."""
        self._check(run_id)
        with self.ctx.db.session() as session:
            rows = session.exec(held_out_scores(run_id, name).order_by(col(VersionScore.version))).all()
        return [_held_out(row) for row in rows]

    def best_by_eval(self, run_id: str) -> HeldOutScore | None:
        """The version with the highest held-out reward (the base model included: training may have made it worse)."""
        self._check(run_id)
        with self.ctx.db.session() as session:
            row = best_held_out(session, run_id)
        return None if row is None else _held_out(row)

    def held_out_count(self, run_id: str) -> int:
        """How many held-out scores the run has: it grows with every evaluation ingested (what tells the Monitor to
        redraw)."""
        self._check(run_id)
        with self.ctx.db.session() as session:
            return int(session.exec(select(func.count()).where(VersionScore.run_id == run_id)).one())

    def alerts(self, run_id: str | None = None) -> list[Event]:
        query = select(Event).where(Event.owner == self.owner, Event.active)
        if run_id is not None:
            self._check(run_id)
            query = query.where(Event.run_id == run_id)
        with self.ctx.db.session() as session:
            return list(session.exec(query.order_by(col(Event.time).desc())).all())

    def alert_history(self, run_id: str, limit: int = 200) -> list[Event]:
        """Every alert the run raised, newest first, whether in force, cleared or dismissed: what was wrong and when,
        after the banner has moved on."""
        self._check(run_id)
        was_alert = or_(
            col(Event.active),
            col(Event.cleared_at).is_not(None),
            col(Event.dismissed),
            col(Event.level).in_(("warning", "error")),
        )
        with self.ctx.db.session() as session:
            query = select(Event).where(Event.run_id == run_id, was_alert)
            return list(session.exec(query.order_by(col(Event.time).desc()).limit(limit)).all())

    def events(self, run_id: str, limit: int = 200) -> list[Event]:
        self._check(run_id)
        with self.ctx.db.session() as session:
            return list(
                session.exec(
                    select(Event).where(Event.run_id == run_id).order_by(col(Event.time).desc()).limit(limit)
                ).all()
            )

    def summary(self, run_id: str) -> RunSummary:
        run = self._check(run_id)
        rewards = [value for _, value in self.metric_series(run_id, "reward", max_points=None)]
        syncs = [value for _, value in self.metric_series(run_id, "perf/weight_sync_s", max_points=None)]
        return RunSummary(
            run=run,
            steps=run.step,
            reward_first5=statistics.fmean(rewards[:5]) if rewards else None,
            reward_last5=statistics.fmean(rewards[-5:]) if rewards else None,
            sync_p50=statistics.median(syncs) if syncs else None,
            versions=len(self.versions(run_id)),
        )


@dataclass
class RunSummary:
    run: Run
    steps: int
    reward_first5: float | None
    reward_last5: float | None
    sync_p50: float | None
    versions: int
