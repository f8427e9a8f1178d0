"""Runs: every run of the owner at a glance, the actions on one, and reward curves of several overlaid.

A branch is drawn from the step its parent version was saved at, so the overlay shows whether it did better than the
parent did from the same point.
"""

from __future__ import annotations

import time
from typing import TypedDict

import gradio as gr
import pandas as pd

from app import cards
from app.actions import branch_from
from app.charts.runs import Curve, overlay_figure
from app.events import Components, Updates
from app.formatting import clock, duration, money
from app.panel import Panel
from backend.api import PanelServices
from backend.database.models import TERMINAL_STATUSES, Run
from backend.services.runs import propose_run_id

REFRESH_SECONDS = 5.0
OVERLAY_STORAGE_KEY = "grpo-panel.runs.overlay"


class SavedOverlay(TypedDict, total=False):
    """The overlay's choices as the browser keeps them (`keep_overlay`); what it sends back is checked again, as it
    may come from an older panel."""

    ticked: list[str] | None
    metric: str
    smoothing: float


OVERLAY_DEFAULTS: SavedOverlay = {"ticked": [], "metric": "reward", "smoothing": 0}
# The key facts first: on a phone only the first columns fit without scrolling sideways.
COLUMNS = ["run id", "status", "step", "latest reward", "name", "elapsed", "cost", "branch of", "created"]


def runs_table(runs: list[Run], now: float | None = None) -> pd.DataFrame:
    now = now or time.time()
    rows = []
    for run in runs:
        elapsed = (run.finished_at or now) - run.started_at if run.started_at else None
        rows.append(
            {
                "run id": run.id,
                "name": run.name,
                "status": cards.badge(run.status),
                "step": f"{run.step} / {run.max_steps}",
                "latest reward": round(run.latest_reward, 3) if run.latest_reward is not None else None,
                "elapsed": duration(elapsed),
                "cost": money(run.cost_usd),
                "branch of": f"{run.parent_run_id} v{run.parent_version}" if run.parent_run_id else "",
                "created": clock(run.created_at),
            }
        )
    return pd.DataFrame(rows, columns=COLUMNS)


class RunsPage:
    def __init__(self, panel: Panel):
        self.panel = panel

    def build(self, saved_overlay: gr.BrowserState | None = None) -> None:
        """The page; `saved_overlay` keeps the overlay's choices in the browser (see `keep_overlay`)."""
        # At phone width the table's first columns are all that fit: its key facts are listed above it instead.
        self.phone_list = gr.HTML("", elem_id="runs-phone", elem_classes="gp-phone-only", padding=False)
        self.table = gr.Dataframe(
            runs_table([]),
            datatype=["str", "html", "str", "number", "str", "str", "str", "str", "str"],
            interactive=False,
            wrap=True,
            elem_id="runs-table",
            max_height=420,
            label="Your runs (click a row to act on it)",
        )
        self.empty = gr.HTML(
            cards.empty_state(
                "No runs yet: launch one from the Launch tab (the demo trains on this machine in about "
                "a minute, with no account)."
            ),
            padding=False,
            visible=False,
        )
        self.selected = gr.State(None)
        with gr.Group():
            self.selection = gr.HTML(
                cards.note("Click a run in the table to open, stop or branch it."),
                elem_id="runs-selection",
                padding=False,
            )
            with gr.Row():
                self.open_button = gr.Button("Open in monitor", elem_id="runs-open", interactive=False)
                self.launch_button = gr.Button("Launch", elem_id="runs-launch", interactive=False)
                self.stop_button = gr.Button("Stop", variant="stop", elem_id="runs-stop", interactive=False)
            with (
                gr.Accordion("Train a branch from one of its versions", open=False),
                gr.Row(elem_classes="gp-align-end"),
            ):
                self.branch_version = gr.Dropdown([], label="From adapter version", elem_id="runs-branch-version")
                self.branch_id = gr.Textbox(label="New run id", elem_id="runs-branch-id")
                self.branch_now = gr.Checkbox(True, label="Start training now")
                self.branch_button = gr.Button("Create branch", elem_id="runs-branch", interactive=False)
        with gr.Row(elem_classes="gp-align-end"):
            self.compare = gr.CheckboxGroup([], label="Overlay the curves of", elem_id="runs-compare", scale=4)
            self.metric = gr.Dropdown(
                ["reward"], value="reward", label="Metric", elem_id="runs-metric", scale=1, allow_custom_value=True
            )
            self.smoothing = gr.Slider(
                0,
                100,
                value=0,
                step=1,
                label="Smoothing window, steps (0: automatic, 1: none)",
                scale=2,
                elem_id="runs-smoothing",
                elem_classes="gp-enter-commits",
            )
        self.overlay = gr.Plot(overlay_figure([]), show_label=False, elem_id="runs-overlay")
        self.saved_overlay = saved_overlay or keep_overlay()
        self.drawn = gr.State(None)  # what the overlay was last drawn from: ticks redraw it only when that changes
        self.timer = gr.Timer(REFRESH_SECONDS, active=False)
        self._wire()

    def refresh_outputs(self) -> Components:
        return [self.phone_list, self.table, self.compare, self.metric, self.overlay, self.drawn, self.empty]

    def overlay_controls(self) -> Components:
        """What the overlay is drawn from, in the order `refresh_now` takes it (and OVERLAY_DEFAULTS lists)."""
        return [self.compare, self.metric, self.smoothing]

    def _wire(self) -> None:
        inputs = [self.compare, self.drawn, self.metric, self.smoothing]
        self.timer.tick(self.refresh, inputs, self.refresh_outputs(), show_progress="hidden")
        for event in (self.compare.change, self.metric.change, self.smoothing.release):  # `drawn` empty: redraw now
            event(
                self.redraw_and_remember,
                self.overlay_controls(),
                [*self.refresh_outputs(), self.saved_overlay],
                show_progress="hidden",
                trigger_mode="always_last",
            )
        self.table.select(
            self.select,
            [self.table],
            [
                self.selected,
                self.selection,
                self.open_button,
                self.launch_button,
                self.stop_button,
                self.branch_version,
                self.branch_id,
                self.branch_button,
            ],
        )
        self.stop_button.click(self.stop, [self.selected], [self.selection]).then(
            self.refresh_now, self.overlay_controls(), self.refresh_outputs()
        )

    # --- handlers -----------------------------------------------------------------------------------------------

    def refresh_now(
        self,
        ticked: list[str] | None,
        metric: str = "reward",
        smoothing: float = 0,
        profile: gr.OAuthProfile | None = None,
    ) -> Updates:
        """Like a tick, but redraws the overlay even if no run moved on (runs ticked or another metric picked)."""
        return self.refresh(ticked, None, metric, smoothing, profile)

    def redraw_and_remember(
        self, ticked: list[str] | None, metric: str, smoothing: float, profile: gr.OAuthProfile | None = None
    ) -> Updates:
        """The overlay's runs, metric or smoothing changed: redraw, and keep them in the browser in the same answer."""
        shown = self.refresh_now(ticked, metric, smoothing, profile)
        return shown | {self.saved_overlay: remember_overlay(ticked, metric, smoothing)}

    def restore(self, saved: SavedOverlay | None, profile: gr.OAuthProfile | None = None) -> Updates:
        """The overlay as this browser last left it (on every page load): the same runs, metric and smoothing."""
        saved = {**OVERLAY_DEFAULTS, **(saved or {})}
        ticked = [run_id for run_id in saved["ticked"] or [] if isinstance(run_id, str)]
        metric = saved["metric"] if isinstance(saved["metric"], str) and saved["metric"] else "reward"
        smoothing = saved["smoothing"] if isinstance(saved["smoothing"], int | float) else 0
        shown = self.refresh_now(ticked, metric, smoothing, profile)
        metrics = gr.Dropdown(choices=shown[self.metric].choices, value=metric)
        return shown | {self.metric: metrics, self.smoothing: smoothing}

    def refresh(
        self,
        ticked: list[str] | None,
        drawn: list[object] | None = None,
        metric: str = "reward",
        smoothing: float = 0,
        profile: gr.OAuthProfile | None = None,
    ) -> Updates:
        """The table, the run choices, the metrics they logged, and the overlay of `metric` (redrawn only when a
        ticked run moved on or another metric was picked)."""
        services = self.panel.services_or_none(profile)
        if services is None:
            return {
                self.phone_list: "",
                self.table: runs_table([]),
                self.compare: gr.CheckboxGroup(choices=[]),
                self.metric: gr.Dropdown(choices=["reward"]),
                self.overlay: overlay_figure([]),
                self.drawn: None,
                self.empty: gr.HTML(visible=False),
            }
        runs = services.runs.list()
        by_id = {run.id: run for run in runs}
        ticked = [run_id for run_id in ticked or [] if run_id in by_id]
        metric, smoothing = metric or "reward", int(smoothing or 0)
        key = [metric, smoothing, *([run_id, by_id[run_id].step, by_id[run_id].status] for run_id in ticked)]
        curves = None if key == drawn else self._curves(services, by_id, ticked, metric)
        overlay = gr.skip() if curves is None else overlay_figure(curves, metric, smoothing)
        logged = sorted({name for run_id in ticked for name in services.queries.metric_names(run_id)} | {"reward"})
        return {
            self.phone_list: cards.run_list(runs),
            self.table: runs_table(runs),
            self.compare: gr.CheckboxGroup(choices=[(f"{r.name or r.id} ({r.id})", r.id) for r in runs], value=ticked),
            self.metric: gr.Dropdown(choices=logged),
            self.overlay: overlay,
            self.drawn: key,
            self.empty: gr.HTML(visible=not runs),
        }

    def _curves(self, services: PanelServices, runs: dict[str, Run], ticked: list[str], metric: str) -> list[Curve]:
        curves = []
        for run_id in ticked:
            run = runs[run_id]
            offset = 0
            if run.parent_run_id and run.parent_run_id in runs and run.parent_version is not None:
                parent = next(
                    (v for v in services.queries.versions(run.parent_run_id) if v.version == run.parent_version), None
                )
                offset = parent.step or 0 if parent else 0
            curves.append(
                Curve(
                    label=f"{run.name or run.id}"
                    + (f" (branch of v{run.parent_version})" if run.parent_run_id else ""),
                    points=services.queries.metric_series(run_id, metric, max_points=1000),
                    offset=offset,
                    branch=run.parent_run_id is not None,
                )
            )
        return curves

    def select(self, table: pd.DataFrame, event: gr.SelectData, profile: gr.OAuthProfile | None = None) -> Updates:
        services = self.panel.services(profile)
        row = event.index[0] if isinstance(event.index, list | tuple) else event.index
        run = services.runs.get(str(table.iloc[row]["run id"]))
        versions = services.queries.versions(run.id)
        choices = [
            (f"v{v.version} · step {v.step}" + (" · best" if v.version == run.best_version else ""), v.version)
            for v in versions
        ]
        default = run.best_version if run.best_version is not None else (versions[-1].version if versions else None)
        active = run.status not in (*TERMINAL_STATUSES, "draft")
        return {
            self.selected: run.id,
            self.selection: cards.selected_run(run, len(versions)),
            self.open_button: gr.Button(interactive=True),
            self.launch_button: gr.Button(interactive=run.status == "draft"),
            self.stop_button: gr.Button(interactive=active),
            self.branch_version: gr.Dropdown(choices=choices, value=default),
            self.branch_id: propose_run_id(self.panel.ctx, "branch"),
            self.branch_button: gr.Button(interactive=bool(versions)),
        }

    def stop(self, run_id: str | None, profile: gr.OAuthProfile | None = None) -> str:
        services = self.panel.services(profile)
        if not run_id:
            return cards.note("Click a run first.", "warn")
        run = services.runs.stop(run_id)
        return cards.note(f"{run.id} is {run.status}: the trainer saves its adapter, then its jobs end.", "info")

    def launch_draft(self, run_id: str | None, profile: gr.OAuthProfile | None = None) -> str | None:
        services = self.panel.services(profile)
        if not run_id:
            return None
        services.runs.launch(run_id)
        return run_id

    def branch(
        self,
        run_id: str | None,
        version: int | None,
        new_id: str,
        start_now: bool,
        profile: gr.OAuthProfile | None = None,
    ) -> str | None:
        """A child run that trains on from `version`; returns its id."""
        return branch_from(
            self.panel.services(profile),
            run_id,
            version,
            new_id,
            start_now,
            "Click a run and pick one of its adapter versions first.",
        )


def keep_overlay() -> gr.BrowserState:
    """The overlay's choices, kept in this browser: a reload opens the same runs, metric and smoothing. Made outside
    the page's tab: Gradio mounts a tab's components when it is first opened, and an unmounted one loads nothing. A
    fixed key rather than a fresh one per server: the choices are not secret, and survive a restarted panel."""
    return gr.BrowserState(dict(OVERLAY_DEFAULTS), storage_key=OVERLAY_STORAGE_KEY, secret=OVERLAY_STORAGE_KEY)


def remember_overlay(ticked: list[str] | None, metric: str, smoothing: float) -> SavedOverlay:
    """What the browser keeps of the overlay (OVERLAY_DEFAULTS's keys)."""
    return {"ticked": list(ticked or []), "metric": metric or "reward", "smoothing": smoothing}
