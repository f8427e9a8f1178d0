"""Prices: what a run costs per hour before launch, and what it has cost so far.

HF Jobs bills each job per minute of its flavor (`list_jobs_hardware` gives `unit_cost_usd` per `unit_label`). Local
runs cost nothing. The poller accumulates a run's cost from its jobs' run times and these prices.
"""

from __future__ import annotations

from backend.context import PanelContext
from backend.database.models import Run
from jobs.contract import RunSpec


def flavor_price_per_hour(ctx: PanelContext, run: Run, flavor: str) -> float | None:
    return ctx.launcher_for(run).price_per_hour(flavor)


def estimate_per_hour(spec: RunSpec, prices: dict[str, float]) -> float:
    """$/hour for the trainer plus every replica, from a flavor -> $/hour table."""
    if spec.compute.backend == "local":
        return 0.0
    missing = [f for f in (spec.compute.trainer_flavor, spec.compute.replica_flavor) if f not in prices]
    if missing:
        known = ", ".join(sorted(prices)) or "none"
        raise ValueError(f"compute: unknown flavor {missing[0]!r}; available flavors: {known}")
    return prices[spec.compute.trainer_flavor] + spec.compute.replicas * prices[spec.compute.replica_flavor]
