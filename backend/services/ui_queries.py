"""Read-only aggregates the panel's pages need that the general query service does not offer.

Each function takes the owner and checks the run belongs to them, like every other service.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func
from sqlmodel import select

from backend.context import PanelContext
from backend.models import MetricPoint, RolloutSample, Run
from backend.services.runs import RunService


@dataclass(frozen=True)
class VersionUse:
    """How many of a step's samples one adapter version generated (and how many were dropped as too stale)."""

    step: int
    policy_version: int
    samples: int
    dropped: int
    trainer_version: int  # the trainer's own version when it pulled them (policy_version + staleness)


def sample_versions(ctx: PanelContext, owner: str, run_id: str, max_steps: int = 400) -> list[VersionUse]:
    """Per step and generating version, over the last `max_steps` steps that have samples: one GROUP BY, not rows."""
    RunService(ctx, owner).get(run_id)
    with ctx.db.session() as session:
        last = session.exec(select(func.max(RolloutSample.step)).where(RolloutSample.run_id == run_id)).first()
        if last is None:
            return []
        rows = session.exec(
            select(
                RolloutSample.step,
                RolloutSample.policy_version,
                func.count(),
                func.sum(RolloutSample.dropped),
                func.max(RolloutSample.policy_version + RolloutSample.staleness),
            )
            .where(RolloutSample.run_id == run_id, RolloutSample.step > last - max_steps)
            .group_by(RolloutSample.step, RolloutSample.policy_version)
            .order_by(RolloutSample.step, RolloutSample.policy_version)
        ).all()
    return [VersionUse(int(s), int(v), int(n), int(d or 0), int(t)) for s, v, n, d, t in rows]


def sample_steps(ctx: PanelContext, owner: str, run_id: str) -> tuple[int, int] | None:
    """The first and last step that have rollout samples (for the sample browser's step slider)."""
    RunService(ctx, owner).get(run_id)
    with ctx.db.session() as session:
        low, high = session.exec(
            select(func.min(RolloutSample.step), func.max(RolloutSample.step)).where(RolloutSample.run_id == run_id)
        ).one()
    return None if low is None else (int(low), int(high))


def recent_values(ctx: PanelContext, owner: str, run_id: str, name: str, count: int = 20) -> list[float]:
    """The last `count` values of one metric, newest first (an index range scan, however long the run)."""
    RunService(ctx, owner).get(run_id)
    with ctx.db.session() as session:
        return list(
            session.exec(
                select(MetricPoint.value)
                .where(MetricPoint.run_id == run_id, MetricPoint.name == name)
                .order_by(MetricPoint.step.desc())
                .limit(count)
            ).all()
        )


def flavor_prices(ctx: PanelContext, owner: str, hf_credential_id: int) -> dict[str, float]:
    """$/hour of every HF Jobs flavor, as the Hub lists them for this owner's token (cached per token)."""
    ctx.vault.get(owner, hf_credential_id)  # raises unless this owner holds the credential
    probe = Run(
        id="price-probe",
        owner=owner,
        spec_json="{}",
        storage_uri="",
        backend="hf_jobs",
        created_at=0.0,
        hf_credential_id=hf_credential_id,
    )
    return ctx.launcher_for(probe).prices_per_hour()
