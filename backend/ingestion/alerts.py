"""Alerts and version aliases, re-evaluated after every poll of a run.

An alert is an `Event` with `active=True`; it is raised once when its condition starts and deactivated when the
condition clears, so the banner shows what is wrong now, and the run's history keeps when it happened.
"""

from __future__ import annotations

import time

from sqlalchemy import and_, or_
from sqlmodel import Session, col, select

from backend.database.connection import Database
from backend.database.models import TERMINAL_STATUSES, AdapterVersion, Event, MetricPoint, Run
from backend.ingestion.ingest import best_held_out, latest_proxy_snapshot, version_reward
from jobs.contract import RunSpec

# TRL's `kl` is the k3 estimate of KL between the policy that sampled a step's rollouts (the replicas' log-probs) and
# the trainer's, per token. It grows when the replicas serve something other than what the trainer published (or the
# samples are very stale); the mean ratio does not show that: it stays near 1 in expectation whatever the mismatch.
# The demo's deliberately large learning rate (0.02, staleness 1) keeps it at 0.1-0.35, so the alert is above that.
KL_TOLERANCE = 0.5  # kl above this ...
KL_STEPS = 5  # ... for this many consecutive logged steps
STALENESS_NEAR = 0.9  # staleness_mean above this fraction of max_staleness


def _set_alert(session: Session, run: Run, kind: str, active: bool, message: str, level: str = "warning") -> None:
    """Raise the alert (at the run's step) when its condition starts; clear it when the condition ends. One that
    its owner dismissed is not raised again until its condition has ended once."""
    in_force = or_(col(Event.active), and_(col(Event.dismissed), col(Event.cleared_at).is_(None)))
    current = session.exec(select(Event).where(Event.run_id == run.id, Event.kind == kind, in_force)).first()
    now = time.time()
    if active and current is None:
        session.add(
            Event(run_id=run.id, owner=run.owner, time=now, level=level, kind=kind, message=message, step=run.step)
        )
    elif not active and current is not None:
        current.active, current.cleared_at = False, now
        session.add(current)


def _series(session: Session, run_id: str, name: str, last: int) -> list[float]:
    rows = session.exec(
        select(MetricPoint.value)
        .where(MetricPoint.run_id == run_id, MetricPoint.name == name)
        .order_by(col(MetricPoint.step).desc())
        .limit(last)
    ).all()
    return list(rows)


def evaluate(db: Database, run_id: str) -> None:
    # Locked: two pollers evaluating the same run would each see no active alert and both raise it.
    with db.session(write_lock=True) as session:
        run = session.get(Run, run_id)
        if run is None:
            return
        if run.status in TERMINAL_STATUSES:
            _clear_warnings(session, run)  # what is wrong *now* no longer applies; errors stay until dismissed
            session.commit()
            return
        spec = RunSpec.from_json(run.spec_json)
        kls = _series(session, run_id, "kl", KL_STEPS)
        drift = len(kls) == KL_STEPS and all(kl > KL_TOLERANCE for kl in kls)
        _set_alert(
            session,
            run,
            "kl_drift",
            drift,
            f"kl between the rollout policy and the trainer's has been above {KL_TOLERANCE} for {KL_STEPS} steps "
            f"(last {kls[0]:.3f}): the replicas may not serve the published policy (see the policy audit)"
            if kls
            else "",
            "warning",
        )
        staleness = _series(session, run_id, "sample/staleness_mean", 1)
        # With max_staleness 1 and a sync every step, samples sit at the limit by design: nothing to warn about.
        near = (
            bool(staleness)
            and spec.grpo.max_staleness >= 2
            and (staleness[0] >= STALENESS_NEAR * spec.grpo.max_staleness)
        )
        _set_alert(
            session,
            run,
            "staleness",
            near,
            f"samples arrive near the staleness limit ({staleness[0]:.2f} of {spec.grpo.max_staleness}): "
            "generation outruns training"
            if staleness
            else "",
            "info",
        )
        _set_alert(session, run, "stalled", run.status == "stalled", run.status_message or "no telemetry", "warning")
        lag = _replica_lag(session, run)
        _set_alert(session, run, "replica_lag", bool(lag), lag, "warning")
        update_best_version(session, run)
        session.add(run)
        session.commit()


def _clear_warnings(session: Session, run: Run) -> None:
    now = time.time()
    for event in session.exec(select(Event).where(Event.run_id == run.id, Event.active, Event.level != "error")).all():
        event.active, event.cleared_at = False, now
        session.add(event)


def _replica_lag(session: Session, run: Run) -> str:
    """Healthy replicas missing a version the proxy considers live, in the proxy's latest snapshot."""
    stats = latest_proxy_snapshot(session, run.id)
    if stats is None:
        return ""
    live = set((stats.get("adapters") or {}).get("live") or [])
    lagging = []
    for replica in stats.get("replicas") or []:
        missing = live - set(replica.get("loaded_versions") or [])
        if replica.get("healthy") and missing:
            lagging.append(f"{replica.get('role', '?')} lacks v{', v'.join(map(str, sorted(missing)))}")
    return f"replicas lag the live adapter versions: {'; '.join(lagging)}" if lagging else ""


def best_by_training_reward(versions: list[AdapterVersion]) -> AdapterVersion | None:
    """The version with the highest training reward around its step, the later one of a tie; None if none has one."""
    rewarded = [version for version in versions if version.reward is not None]
    return max(rewarded, key=lambda version: (version.reward or 0.0, version.version)) if rewarded else None


def update_best_version(session: Session, run: Run) -> None:
    """The `best` alias: the adapter version with the highest held-out reward once versions are evaluated (prompts the
    run never trained on), else the highest training reward around its step."""
    versions = list(session.exec(select(AdapterVersion).where(AdapterVersion.run_id == run.id)).all())
    for version in versions:
        if version.reward is None and version.step is not None:
            version.reward = version_reward(session, run.id, version.step)
            session.add(version)
    held_out = best_held_out(session, run.id, adapters_only=True)
    if held_out is not None:
        run.best_version = held_out.version
    else:
        best = best_by_training_reward(versions)
        run.best_version = best.version if best is not None else None
