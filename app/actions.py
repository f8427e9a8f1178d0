"""Actions more than one page offers, written once."""

from __future__ import annotations

import gradio as gr

from backend.api import PanelServices


def branch_from(
    services: PanelServices, run_id: str | None, version: int | None, new_id: str, start_now: bool, missing: str
) -> str:
    """Start a child run that trains on from `version` of `run_id` (made current); returns the child's id.

    `missing` is what to tell the user when no run or version is picked (each page asks for it differently).
    """
    if not run_id or version is None:
        raise gr.Error(missing)
    child = services.adapters.branch(run_id, int(version), (new_id or "").strip(), launch=bool(start_now))
    gr.Info(f"Created {child.id}, a branch of {run_id} from v{version}.")
    return child.id
