"""What a run's jobs cost, and the cap its owner set on it."""

from __future__ import annotations

from typing import cast

from backend.context import PanelContext
from backend.database.models import Job, Run
from backend.services.runs import RunService


def job_cost(job: Job, now: float) -> float:
    if not job.price_per_hour or job.started_at is None:
        return 0.0
    end = job.finished_at or now
    return max(0.0, end - job.started_at) / 3600 * job.price_per_hour


def enforce_cost_cap(ctx: PanelContext, run_id: str) -> None:
    """Stop a run gracefully once it has cost what its owner allowed (`compute.cost_cap_usd`)."""
    with ctx.db.session() as session:
        run = cast(Run, session.get(Run, run_id))  # a run deleted mid-pass fails the pass (poller.py)
    if run.cost_usd <= 0:  # local runs, and the first minutes of any run: nothing to compare yet
        return
    cap = ctx.spec(run).compute.cost_cap_usd
    if cap is not None and run.cost_usd >= cap:
        reason = f"cost cap reached: ${run.cost_usd:.2f} of ${cap:.2f}"
        RunService(ctx, run.owner).stop(run_id, reason, kind="cost_cap", level="warning")
