"""Reporting to Trackio and W&B besides the panel, as TRL reports: transformers' `report_to` callbacks, TRL's metric
names, one run per run id in the spec's project.

The packages are not in the job image and most runs never use them, so a trainer installs the one its run picked
(pinned in requirements-reporting.txt) before TRL builds its callbacks; local runs have them from the panel's
requirements.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jobs.contract import RunSpec
from jobs.pins import install_missing, missing, pins

REQUIREMENTS = Path(__file__).resolve().parents[2] / "requirements-reporting.txt"


def report_arguments(spec: RunSpec) -> dict[str, Any]:
    """The TrainingArguments that send the run's metrics where its spec says (only "none" when nowhere)."""
    reporting = spec.reporting
    report_to = reporting.report_to()
    if not report_to:
        return {"report_to": "none"}
    arguments: dict[str, Any] = {"report_to": report_to, "run_name": spec.run_id, "project": reporting.project}
    if reporting.trackio:
        # A Space hosts the live dashboard (None: a local project); no static Space is made behind the user's back.
        arguments |= {"trackio_space_id": reporting.trackio_space, "trackio_static_space_id": False}
    return arguments


def report_environment(spec: RunSpec) -> dict[str, str]:
    """What wandb reads from the environment only (transformers' `project` reaches Trackio alone)."""
    if not spec.reporting.wandb:
        return {}
    environment = {"WANDB_PROJECT": spec.reporting.project}
    if spec.reporting.wandb_entity:
        environment["WANDB_ENTITY"] = spec.reporting.wandb_entity
    return environment


def reporting_packages(spec: RunSpec, path: Path = REQUIREMENTS) -> list[str]:
    """`name==version` of each reporting package the run picked, at its pin."""
    pinned = pins(path)
    return [f"{name}=={pinned[name]}" for name in spec.reporting.report_to()]


def missing_packages(spec: RunSpec, path: Path = REQUIREMENTS) -> list[str]:
    """The reporting packages the run picked that this interpreter lacks at their pins."""
    return missing(reporting_packages(spec, path))


def install_reporting_packages(spec: RunSpec, path: Path = REQUIREMENTS) -> list[str]:
    """Install what `missing_packages` names (in the main process; the other ranks wait for it); what was installed."""
    return install_missing(
        reporting_packages(spec, path),
        f"to report to {', '.join(spec.reporting.report_to())} (or relaunch without reporting.trackio / "
        "reporting.wandb)",
    )
