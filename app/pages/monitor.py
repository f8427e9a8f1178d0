"""Run monitor: one run, live — progress, alerts, jobs, training curves, the rollout pipeline, replicas, samples.

A `gr.Timer` refreshes the page every two seconds while it is the open tab. Each tick reads the run row first and
redraws the figures of the visible sub-tab only when the run has logged something new since they were last drawn;
everything else is skipped, so an idle viewer costs one small query per tick.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TypeAlias, TypedDict, TypeVar, cast

import gradio as gr
import pandas as pd

from app import cards
from app.charts import replicas as replica_charts
from app.charts import rollouts as rollout_charts
from app.charts import training as training_charts
from app.charts.style import ChartOptions, elapsed_axis
from app.events import Components, Updates
from app.panel import Panel
from backend.api import PanelServices
from backend.database.models import TERMINAL_STATUSES, RolloutSample, Run
from backend.launchers.base import TERMINAL
from backend.services.adapters import VersionNotFound
from backend.services.exports import FORMATS as EXPORT_FORMATS
from backend.services.exports import ExportFormat
from backend.services.queries import JobLog, SampleFilters
from backend.services.runs import RunNotFound
from jobs.contract import RunSpec, derived

REFRESH_SECONDS = 2.0
LOG_REFRESH_SECONDS = 3.0  # a followed job log is read again this often while its job runs
MAX_POINTS = 1000
X_AXES = ("step", "wall time", "generated tokens")  # what the training figures' x axis may count
SUBTABS = ("training", "rollouts", "replicas", "samples", "jobs")
SAMPLE_COLUMNS = ["step", "group", "reward", "advantage", "version", "staleness", "scores", "prompt", "completion"]
SAMPLES_PER_PAGE = 200
CHART_STORAGE_KEY = "grpo-panel.monitor.charts"


class SavedCharts(TypedDict, total=False):
    """The Training tab's chart controls as the browser keeps them (`keep_charts`); what it sends back is checked
    again, as it may come from an older panel."""

    smoothing: float
    log_y: bool
    x_axis: str
    more_metrics: list[str]


CHART_DEFAULTS: SavedCharts = {"smoothing": 0, "log_y": False, "x_axis": "step", "more_metrics": []}
Drawn: TypeAlias = dict[str, list[object]]
"""Sub-tab -> the run state its figures were drawn from (kept in a `gr.State` between ticks)."""


def run_choices(services: PanelServices | None) -> list[tuple[str, str]]:
    if services is None:
        return []
    return [(f"{run.name or run.id} · {run.id}", run.id) for run in services.runs.list()]


class MonitorPage:
    def __init__(self, panel: Panel):
        self.panel = panel
        # Exports are handed to Gradio from here: a temp folder it may serve from, as the Adapters page's zips.
        self.exports = Path(tempfile.mkdtemp(prefix="grpo-panel-exports-"))

    # --- layout -------------------------------------------------------------------------------------------------

    def build(self, saved_charts: gr.BrowserState | None = None) -> None:
        """The page; `saved_charts` keeps the chart controls in the browser (see `keep_charts`)."""
        with gr.Row(elem_classes="gp-align-end"):
            self.run = gr.Dropdown([], label="Run", elem_id="monitor-run", scale=4, allow_custom_value=False)
            self.stop_button = gr.Button(
                "Stop run", variant="stop", elem_id="stop-run", scale=0, min_width=130, interactive=False
            )
        self.header = gr.HTML(
            cards.empty_state("Pick a run above, or launch one from the Launch tab."),
            elem_id="run-header",
            padding=False,
        )
        self.alerts = gr.HTML("", elem_id="run-alerts", padding=False, visible=False)
        self.subtab = gr.State("training")
        self.drawn = gr.State({})  # sub-tab -> the run state its figures were drawn from
        self.undrawn = gr.State({})  # never written: what `redraw_inputs` passes as `drawn`
        with gr.Tabs():
            with gr.Tab("Training", id="training") as self.training_tab:
                with gr.Row(elem_classes="gp-align-end"):
                    self.smoothing = gr.Slider(
                        0,
                        100,
                        value=0,
                        step=1,
                        label="Smoothing window, steps (0: automatic, 1: none; the raw reward stays drawn)",
                        scale=3,
                        elem_id="chart-smoothing",
                        elem_classes="gp-enter-commits",
                    )
                    self.x_axis = gr.Radio(list(X_AXES), value="step", label="x axis", scale=2, elem_id="chart-x-axis")
                    self.log_y = gr.Checkbox(False, label="Log scale", scale=1, elem_id="chart-log")
                with gr.Row():
                    self.reward_plot = gr.Plot(
                        training_charts.reward_figure([]), elem_id="reward-plot", show_label=False
                    )
                    self.functions_plot = gr.Plot(training_charts.reward_functions_figure({}), show_label=False)
                self.eval_plot = gr.Plot(training_charts.held_out_figure([], []), elem_id="eval-plot", show_label=False)
                with gr.Row():
                    self.ratio_plot = gr.Plot(training_charts.ratio_kl_figure([], []), show_label=False)
                    self.time_plot = gr.Plot(training_charts.step_time_figure([], [], [], []), show_label=False)
                self.more_metrics = gr.Dropdown(
                    [],
                    value=[],
                    multiselect=True,
                    label="More metrics: any the run logged (loss, grad_norm, entropy, …), each in its own chart",
                    elem_id="more-metrics",
                )
                self.more_plot = gr.Plot(
                    training_charts.metrics_figure({}), show_label=False, elem_id="more-metrics-plot"
                )
                self.saved_charts = saved_charts or keep_charts()
                with gr.Row(elem_classes="gp-align-end"):
                    self.export_format = gr.Radio(
                        list(EXPORT_FORMATS), value="csv", label="Export format", scale=1, elem_id="export-format"
                    )
                    self.export_button = gr.Button(
                        "Export metrics and samples", scale=1, elem_id="export-run", variant="secondary"
                    )
                    self.exported = gr.File(
                        label="Exported (one row per step; one row per sample)",
                        file_count="multiple",
                        interactive=False,
                        visible=False,
                        scale=2,
                        elem_id="exported-files",
                    )
            with gr.Tab("Rollouts", id="rollouts") as self.rollouts_tab:
                with gr.Row():
                    self.queue_plot = gr.Plot(rollout_charts.queue_figure([], 0, []), show_label=False)
                    self.staleness_plot = gr.Plot(rollout_charts.staleness_figure([], [], 0), show_label=False)
                with gr.Row():
                    self.tokens_plot = gr.Plot(rollout_charts.tokens_figure([]), show_label=False)
                    self.versions_plot = gr.Plot(rollout_charts.sample_versions_figure([]), show_label=False)
            with gr.Tab("Replicas & sync", id="replicas") as self.replicas_tab:
                self.held = gr.HTML(cards.empty_state("Pick a run."), elem_id="versions-held", padding=False)
                with gr.Row():
                    self.routing_plot = gr.Plot(replica_charts.routing_figure([]), show_label=False)
                    self.load_plot = gr.Plot(replica_charts.replica_load_figure(None), show_label=False)
                self.sync_plot = gr.Plot(replica_charts.sync_figure(None), show_label=False)
            with gr.Tab("Samples", id="samples") as self.samples_tab:
                with gr.Row(elem_classes="gp-align-end"):
                    self.step = gr.Slider(
                        1,
                        2,
                        value=1,
                        step=1,
                        label="Step",
                        elem_id="sample-step",
                        scale=4,
                        elem_classes="gp-enter-commits",
                    )
                    self.follow = gr.Checkbox(True, label="Follow the latest step", scale=1)
                    self.min_reward = gr.Textbox(label="Reward ≥", placeholder="any", scale=1, elem_id="min-reward")
                    self.max_reward = gr.Textbox(label="Reward ≤", placeholder="any", scale=1, elem_id="max-reward")
                with gr.Row(elem_classes="gp-align-end"):
                    self.search = gr.Textbox(
                        label="Search prompts and completions (Enter)", scale=4, elem_id="sample-search"
                    )
                    self.version = gr.Textbox(label="Version", placeholder="any", scale=1, elem_id="sample-version")
                    self.turns = gr.Textbox(label="Episode turns ≥", placeholder="any", scale=1, elem_id="sample-turns")
                    self.all_steps = gr.Checkbox(False, label="All steps", scale=1, elem_id="sample-all-steps")
                    self.page = gr.Number(
                        1, label="Page (Enter)", precision=0, minimum=1, scale=1, elem_id="sample-page"
                    )
                self.sample_count = gr.HTML("", elem_id="sample-count", padding=False)
                self.samples = gr.Dataframe(
                    pd.DataFrame(columns=SAMPLE_COLUMNS),
                    interactive=False,
                    wrap=True,
                    max_height=320,
                    elem_id="samples-table",
                    label="Samples (click one to compare its group)",
                    column_widths=["5%", "5%", "6%", "7%", "10%", "6%", "13%", "18%", "30%"],
                )
                with gr.Row(equal_height=False):
                    self.best = gr.HTML(
                        cards.empty_state("The best sample of the selected group appears here."),
                        elem_id="best-sample",
                        padding=False,
                    )
                    self.worst = gr.HTML(
                        cards.empty_state("The worst sample of the selected group appears here."),
                        elem_id="worst-sample",
                        padding=False,
                    )
            with gr.Tab("Jobs", id="jobs") as self.jobs_tab:
                self.jobs = gr.HTML(cards.empty_state("Pick a run."), elem_id="job-cards", padding=False)
                with gr.Accordion("A job's whole log", open=False):
                    with gr.Row(elem_classes="gp-align-end"):
                        self.log_job = gr.Dropdown([], label="Job", scale=2, elem_id="log-job")
                        self.log_search = gr.Textbox(label="Only lines containing", scale=3, elem_id="log-search")
                        self.log_button = gr.Button("Show the log", scale=1, elem_id="show-log")
                    self.log_text = gr.Code("", label="Log", lines=12, max_lines=30, elem_id="job-log")
                    self.log_file = gr.DownloadButton("Download the log", visible=False, elem_id="download-log")
                    self.log_timer = gr.Timer(LOG_REFRESH_SECONDS, active=False)
                gr.Markdown("### Alerts", elem_classes="gp-section-title")
                self.alert_list = gr.HTML("", elem_id="alert-history", padding=False)
                with gr.Row(elem_classes="gp-align-end"):
                    self.alert_pick = gr.Dropdown(
                        [], label="Alert in force", scale=4, elem_id="alert-pick", visible=False
                    )
                    self.dismiss_button = gr.Button("Dismiss", scale=1, elem_id="dismiss-alert", visible=False)
        self.timer = gr.Timer(REFRESH_SECONDS, active=False)
        self._wire()

    def refresh_outputs(self) -> Components:
        """Everything a tick may redraw; each tick answers only what changed (`refresh`)."""
        return [
            self.header,
            self.alerts,
            self.drawn,
            self.stop_button,
            *(self.reward_plot, self.functions_plot, self.eval_plot, self.ratio_plot, self.time_plot),
            *(self.more_metrics, self.more_plot),
            *(self.queue_plot, self.staleness_plot, self.tokens_plot, self.versions_plot),
            *(self.held, self.routing_plot, self.load_plot, self.sync_plot),
            *(self.step, self.sample_count, self.samples, self.best, self.worst),
            *(self.jobs, self.log_job, self.alert_list, self.alert_pick, self.dismiss_button),
        ]

    def sample_filters(self) -> Components:
        """The Samples tab's filters, in the order every handler that lists samples takes them."""
        return [self.min_reward, self.max_reward, self.search, self.version, self.all_steps, self.page, self.turns]

    def refresh_inputs(self) -> Components:
        return [
            self.run,
            self.subtab,
            self.drawn,
            self.step,
            self.follow,
            *self.sample_filters(),
            *self.chart_controls(),
        ]

    def redraw_inputs(self) -> Components:
        """A tick's inputs with nothing drawn yet: the visible sub-tab is redrawn even if the run logged nothing new
        (another run, sub-tab or chart option was picked)."""
        return [self.undrawn if component is self.drawn else component for component in self.refresh_inputs()]

    def chart_controls(self) -> Components:
        """The Training tab's chart controls, in the order the refresh handlers take them (and CHART_DEFAULTS lists)."""
        return [self.smoothing, self.log_y, self.x_axis, self.more_metrics]

    def _wire(self) -> None:
        self.timer.tick(self.refresh, self.refresh_inputs(), self.refresh_outputs(), show_progress="hidden")
        self.run.change(self.refresh, self.redraw_inputs(), self.refresh_outputs(), show_progress="hidden")
        tabs = (self.training_tab, self.rollouts_tab, self.replicas_tab, self.samples_tab, self.jobs_tab)
        for name, tab in zip(SUBTABS, tabs, strict=True):
            tab.select(_constant(name), None, self.subtab).then(
                self.refresh, self.redraw_inputs(), self.refresh_outputs(), show_progress="hidden"
            )
        self.export_button.click(self.export, [self.run, self.export_format], [self.exported])
        for event in (self.log_button.click, self.log_search.submit, self.log_timer.tick):
            event(
                self.show_log,
                [self.run, self.log_job, self.log_search],
                [self.log_text, self.log_file, self.log_timer],
                show_progress="hidden",
            )
        self.dismiss_button.click(self.dismiss, [self.run, self.alert_pick], None).then(
            self.refresh, self.redraw_inputs(), self.refresh_outputs(), show_progress="hidden"
        )
        self.stop_button.click(self.stop, [self.run], None).then(
            self.refresh, self.redraw_inputs(), self.refresh_outputs(), show_progress="hidden"
        )
        browse = [self.run, self.step, *self.sample_filters()]
        shown = [self.sample_count, self.samples, self.best, self.worst]
        # The step box commits on Enter too (theme.HEAD turns Enter into the blur on which Gradio sends `release`).
        self.step.release(lambda: (False, 1), None, [self.follow, self.page]).then(self.browse, browse, shown)
        for box in (self.min_reward, self.max_reward, self.search, self.version, self.turns):
            box.submit(lambda: 1, None, self.page).then(self.browse, browse, shown)
        self.page.submit(self.browse, browse, shown)
        # always_last: a second metric picked while the first one's charts are drawn is drawn too (Gradio's default
        # drops an event raised while the previous one runs).
        for event in (self.smoothing.release, self.log_y.input, self.x_axis.input, self.more_metrics.input):
            event(
                self.redraw_and_remember,
                self.redraw_inputs(),
                [*self.refresh_outputs(), self.saved_charts],
                show_progress="hidden",
                trigger_mode="always_last",
            )
        self.all_steps.input(lambda: 1, None, self.page).then(self.browse, browse, shown)
        self.samples.select(self.pick_group, [self.run, self.samples], [self.best, self.worst])

    # --- handlers -----------------------------------------------------------------------------------------------

    def open(self, run_id: str | None, saved: SavedCharts | None, profile: gr.OAuthProfile | None = None) -> Updates:
        """The tab was opened: refresh the run list, keeping the run shown (or the newest) selected, and set the chart
        controls as this browser last left them, in the same answer: the drawing that a newly picked run starts is
        asked with them (restored on their own, on page load, they could arrive after it, and only a tick redrew)."""
        choices = run_choices(self.panel.services_or_none(profile))
        ids = [value for _, value in choices]
        picked = run_id if run_id in ids else (ids[0] if ids else None)
        return {self.run: gr.Dropdown(choices=choices, value=picked)} | self.restore_charts(saved)

    def open_outputs(self) -> Components:
        return [self.run, *self.chart_controls()]

    def refresh(
        self,
        run_id: str | None,
        subtab: str,
        drawn: Drawn | None,
        step: float | None,
        follow: bool,
        min_reward: str,
        max_reward: str,
        search: str,
        version: str,
        all_steps: bool,
        page: float | None = 1,
        turns: str = "",
        smoothing: float = 0,
        log_y: bool = False,
        x_axis: str = "step",
        more_metrics: list[str] | None = None,
        profile: gr.OAuthProfile | None = None,
    ) -> Updates:
        """One tick: the header and alerts always; the visible sub-tab only when the run logged something new
        (what a tick leaves out of its answer stays as it is on the page)."""
        services = self.panel.services_or_none(profile)
        if services is None or not run_id:
            message = (
                "Sign in on the Account tab to see your runs."
                if services is None
                else "Pick a run above, or launch one from the Launch tab."
            )
            return self._frame(cards.empty_state(message), "", {}, stoppable=False)
        try:
            run = services.runs.get(run_id)
        except RunNotFound:
            return self._frame(cards.empty_state(f"No run {run_id}."), "", {}, stoppable=False)
        # The held-out scores counted too: an evaluation may be ingested without any other telemetry changing. And the
        # chart controls: restored from the browser after a reload, they may arrive after the first drawing.
        held_out = services.queries.held_out_count(run.id)
        charts = [smoothing, log_y, x_axis, sorted(more_metrics or [])]
        state = [run.id, run.status, run.step, run.last_telemetry_at, run.current_version, run.best_version, held_out]
        state += charts
        step_seconds = services.queries.step_seconds(run.id) if run.status not in ("finished", "stopped") else None
        header = cards.run_header(
            run,
            step_seconds,
            current_step=_current_step(services, run),
            sample_use=services.queries.sample_use(run.id),
            best_by_eval=services.queries.best_by_eval(run.id) if held_out else None,
        )
        alerts = services.queries.alerts(run.id)  # the poller clears an ended run's warnings
        if run.status == "failed" and run.status_message:  # said once, in the banner: not again as an alert
            failure = run.status_message
            alerts = [a for a in alerts if a.message not in failure and failure not in a.message]
            banner = cards.note(f"The run failed: {failure}", "bad") + cards.alert_banner(alerts)
        else:
            banner = cards.alert_banner(alerts)
        drawn = dict(drawn or {})
        figures: Updates = {}
        if subtab == "jobs":
            figures = self._jobs(services, run)
        elif subtab == "samples":
            wanted = SampleFilter.read(min_reward, max_reward, search, version, all_steps, page, turns)
            figures = self._samples(services, run, step, follow, wanted, fresh=drawn.get(subtab) != state)
            drawn[subtab] = state
        elif subtab == "training" and drawn.get(subtab) != state:
            options = _chart_options(services, run.id, smoothing, log_y, x_axis)
            figures = self._training(services, run, options, more_metrics or [])
            drawn[subtab] = state
        elif subtab in SUBTABS and drawn.get(subtab) != state:
            figures = getattr(self, f"_{subtab}")(services, run)
            drawn[subtab] = state
        stoppable = run.status not in (*TERMINAL_STATUSES, "draft", "stopping")
        return self._frame(header, banner, drawn, stoppable) | figures

    def _frame(self, header: str, banner: str, drawn: Drawn, stoppable: bool) -> Updates:
        """What every tick answers: the header, the alert banner (hidden when empty), what has been drawn, and
        whether Stop has anything to stop."""
        return {
            self.header: header,
            self.alerts: gr.HTML(banner, visible=bool(banner)),
            self.drawn: drawn,
            self.stop_button: gr.Button(interactive=stoppable),
        }

    def _jobs(self, services: PanelServices, run: Run) -> Updates:
        """Job cards, and the run's alert history with the alerts still in force to dismiss."""
        jobs, beats = services.queries.jobs(run.id), services.queries.heartbeats(run.id)
        history = services.queries.alert_history(run.id)
        in_force = [(f"{a.kind.replace('_', ' ')} · {a.message[:80]}", cast(int, a.id)) for a in history if a.active]
        return {
            self.log_job: gr.Dropdown(
                choices=[(f"{job.role} (attempt {job.attempt})", cast(int, job.id)) for job in jobs]  # stored: ids set
            ),
            self.jobs: cards.job_cards(jobs, beats, local=run.backend == "local"),
            self.alert_list: cards.alert_history(history),
            self.alert_pick: gr.Dropdown(choices=in_force, visible=bool(in_force)),
            self.dismiss_button: gr.Button(visible=bool(in_force)),
        }

    def redraw_and_remember(
        self,
        run_id: str | None,
        subtab: str,
        drawn: Drawn | None,
        step: float | None,
        follow: bool,
        min_reward: str,
        max_reward: str,
        search: str,
        version: str,
        all_steps: bool,
        page: float | None,
        turns: str,
        smoothing: float,
        log_y: bool,
        x_axis: str,
        more_metrics: list[str] | None,
        profile: gr.OAuthProfile | None = None,
    ) -> Updates:
        """A chart control changed: redraw (`refresh`, same inputs), and keep the controls in the browser in the same
        answer, so that a reload right after the change keeps it."""
        filters = (min_reward, max_reward, search, version, all_steps, page, turns)
        charts = (smoothing, log_y, x_axis, more_metrics)
        shown = self.refresh(run_id, subtab, drawn, step, follow, *filters, *charts, profile=profile)
        return shown | {self.saved_charts: remember_charts(*charts)}

    def restore_charts(self, saved: SavedCharts | None) -> Updates:
        """The chart controls as this browser last left them."""
        saved = {**CHART_DEFAULTS, **(saved or {})}
        more = [name for name in saved["more_metrics"] if isinstance(name, str)]
        return {
            self.smoothing: saved["smoothing"],
            self.log_y: saved["log_y"],
            self.x_axis: saved["x_axis"] if saved["x_axis"] in X_AXES else "step",
            self.more_metrics: gr.Dropdown(choices=more, value=more, multiselect=True),
        }

    def _training(self, services: PanelServices, run: Run, options: ChartOptions, more: list[str]) -> Updates:
        series = services.queries.metric_series
        spec = RunSpec.from_json(run.spec_json)
        functions = {r.name: series(run.id, f"rewards/{r.name}", MAX_POINTS) for r in spec.rewards}
        held_out_series = services.queries.held_out_series
        reward = series(run.id, "reward", MAX_POINTS)
        return {
            self.reward_plot: training_charts.reward_figure(reward, options),
            self.functions_plot: training_charts.reward_functions_figure(functions, options),
            self.eval_plot: training_charts.held_out_figure(
                held_out_series(run.id),
                reward,
                {r.name: held_out_series(run.id, f"rewards/{r.name}") for r in spec.rewards},
                options,
                {m.name: held_out_series(run.id, f"metrics/{m.name}") for m in spec.eval.metrics},
            ),
            self.ratio_plot: training_charts.ratio_kl_figure(
                series(run.id, "ratio", MAX_POINTS), series(run.id, "kl", MAX_POINTS), options=options
            ),
            self.time_plot: training_charts.step_time_figure(
                series(run.id, "perf/step_s", MAX_POINTS),
                series(run.id, "perf/fwd_bwd_s", MAX_POINTS),
                series(run.id, "perf/rollout_wait_s", MAX_POINTS),
                series(run.id, "perf/weight_sync_s", MAX_POINTS),
                options,
            ),
            self.more_metrics: gr.Dropdown(choices=sorted(set(services.queries.metric_names(run.id)) | set(more))),
            self.more_plot: training_charts.metrics_figure(
                {name: series(run.id, name, MAX_POINTS) for name in more}, options
            ),
        }

    def _rollouts(self, services: PanelServices, run: Run) -> Updates:
        series = services.queries.metric_series
        spec = RunSpec.from_json(run.spec_json)
        queue_max = derived.rollout_limits(spec).queue
        return {
            self.queue_plot: rollout_charts.queue_figure(
                series(run.id, "sample/rollout_queue_size", MAX_POINTS),
                queue_max,
                series(run.id, "rollout/backpressure_s", MAX_POINTS),
            ),
            self.staleness_plot: rollout_charts.staleness_figure(
                series(run.id, "sample/staleness_mean", MAX_POINTS),
                series(run.id, "sample/staleness_max", MAX_POINTS),
                spec.grpo.max_staleness,
            ),
            self.tokens_plot: rollout_charts.tokens_figure(series(run.id, "rollout/generated_tok_s", MAX_POINTS)),
            self.versions_plot: rollout_charts.sample_versions_figure(services.queries.sample_versions(run.id)),
        }

    def _replicas(self, services: PanelServices, run: Run) -> Updates:
        snapshots = services.queries.proxy_snapshots(run.id, limit=360)
        latest = snapshots[-1] if snapshots else None
        versions = services.queries.versions(run.id)
        newest = versions[-1].version if versions else None
        return {
            self.held: cards.versions_held(latest, services.queries.heartbeats(run.id), newest),
            self.routing_plot: replica_charts.routing_figure(snapshots),
            self.load_plot: replica_charts.replica_load_figure(latest),
            self.sync_plot: replica_charts.sync_figure(latest),
        }

    def _samples(
        self, services: PanelServices, run: Run, step: float | None, follow: bool, wanted: SampleFilter, fresh: bool
    ) -> Updates:
        if not fresh:  # nothing new arrived since the last draw; the filters redraw through their own events
            return {}
        bounds = services.queries.sample_steps(run.id)
        if bounds is None:
            return {
                self.step: gr.Slider(minimum=1, maximum=2, value=1),
                self.sample_count: "",
                self.samples: _samples_table([]),
                self.best: cards.empty_state(
                    "Samples appear as soon as the trainer pulls its first batch of rollouts."
                ),
                self.worst: cards.empty_state(
                    "Each sample shows its prompt, completion, scores, advantage and version."
                ),
            }
        low, high = bounds
        target = high if follow or not step else min(max(int(step), low), high)
        if not follow:  # the reader is on an older step: only let the slider reach the new ones
            return {self.step: gr.Slider(minimum=low, maximum=max(high, low + 1))}
        slider = {self.step: gr.Slider(minimum=low, maximum=max(high, low + 1), value=target)}
        return slider | self._browse(services, run.id, target, wanted)

    def _browse(self, services: PanelServices, run_id: str, step: int, wanted: SampleFilter) -> Updates:
        """One page of the samples of one step (or of every step) that pass the filters, how many there are, and the
        best and worst of the group listed first. A filter box that cannot be read lists nothing and says why: a
        table that ignored it would look filtered."""
        if wanted.refused:
            return {
                self.sample_count: cards.note(" ".join(wanted.refused), "bad"),
                self.samples: _samples_table([]),
                self.best: cards.empty_state("Fix the filter above to list samples."),
                self.worst: cards.empty_state(""),
            }
        filters = wanted.query(step)
        total = services.queries.count_samples(run_id, filters)
        pages = max(1, -(-total // SAMPLES_PER_PAGE))
        page = min(wanted.page, pages)
        offset = (page - 1) * SAMPLES_PER_PAGE
        rows = services.queries.samples(run_id, **asdict(filters), limit=SAMPLES_PER_PAGE, offset=offset)
        first = (rows[0].step, rows[0].group_id) if rows else (step, None)
        count = cards.sample_count(offset, len(rows), total, page, pages)
        return {self.sample_count: count, self.samples: _samples_table(rows)} | self._group_cards(
            services, run_id, *first
        )

    def _group_cards(self, services: PanelServices, run_id: str, step: int, group: int | None) -> Updates:
        if group is None:
            return {
                self.best: cards.empty_state("No sample matches these filters."),
                self.worst: cards.empty_state("Widen the filters or pick another step."),
            }
        members = services.queries.group(run_id, int(step), int(group))
        if not members:
            return {self.best: cards.empty_state("This group has no samples."), self.worst: ""}
        return {
            self.best: cards.sample_card(f"Best of group {group} ({len(members)} samples)", members[0]),
            self.worst: cards.sample_card(f"Worst of group {group}", members[-1]),
        }

    def browse(
        self,
        run_id: str | None,
        step: float,
        min_reward: str,
        max_reward: str,
        search: str,
        version: str,
        all_steps: bool,
        page: float | None = 1,
        turns: str = "",
        profile: gr.OAuthProfile | None = None,
    ) -> Updates:
        services = self.panel.services(profile)
        if not run_id:
            return {self.samples: gr.skip()}  # not {}: Gradio takes an empty dict for a single value
        wanted = SampleFilter.read(min_reward, max_reward, search, version, all_steps, page, turns)
        return self._browse(services, run_id, int(step), wanted)

    def pick_group(
        self, run_id: str, table: pd.DataFrame, event: gr.SelectData, profile: gr.OAuthProfile | None = None
    ) -> Updates:
        services = self.panel.services(profile)
        row = table.iloc[event.index[0] if isinstance(event.index, list | tuple) else event.index]
        return self._group_cards(services, run_id, int(row["step"]), int(row["group"]))

    def export(self, run_id: str | None, fmt: ExportFormat, profile: gr.OAuthProfile | None = None) -> Updates:
        """The run's metrics and samples as files to save (the same files `python -m backend export` writes)."""
        services = self.panel.services(profile)
        if not run_id:
            raise gr.Error("Pick a run to export.")
        folder = Path(tempfile.mkdtemp(dir=self.exports))  # one folder per export: a later one never overwrites it
        paths = services.exports.export(run_id, fmt, folder)
        return {self.exported: gr.File(value=[str(path) for path in paths], visible=True)}

    def show_log(
        self, run_id: str | None, job_id: int | None, search: str, profile: gr.OAuthProfile | None = None
    ) -> Updates:
        """One job's log as its launcher has it now, followed while the job runs, only the lines holding `search`
        if given; the whole of it to download either way."""
        services = self.panel.services(profile)
        if not run_id or job_id is None:
            return {
                self.log_text: gr.Code("", label="Pick a job whose log to show"),
                self.log_timer: gr.Timer(active=False),
            }
        path = self.exports / f"{run_id}-job-{int(job_id)}.log"  # rewritten as the log grows (Gradio serves a copy)
        log = services.queries.job_log(run_id, int(job_id), path, search or "")
        running = any(job.id == int(job_id) and job.stage not in TERMINAL for job in services.queries.jobs(run_id))
        return {
            self.log_text: gr.Code("\n".join(log.shown), label=log_label(log, running)),
            self.log_file: gr.DownloadButton(
                f"Download the whole log ({log.total:,} lines)", value=str(log.path), visible=True
            ),
            self.log_timer: gr.Timer(active=running),  # a running job's log is read again until the job ends
        }

    def dismiss(self, run_id: str | None, alert_id: int | None, profile: gr.OAuthProfile | None = None) -> None:
        services = self.panel.services(profile)
        if not run_id or alert_id is None:
            raise gr.Error("Pick an alert in force to dismiss.")
        services.runs.dismiss_alert(run_id, int(alert_id))

    def stop(self, run_id: str | None, profile: gr.OAuthProfile | None = None) -> None:
        services = self.panel.services(profile)
        if not run_id:
            raise gr.Error("Pick a run to stop.")
        run = services.runs.stop(run_id)
        if run.status == "stopping":
            gr.Info(f"Stopping {run_id}: the trainer saves its adapter, then the jobs end.")
        else:
            gr.Info(f"{run_id} is {run.status}: there is nothing to stop.")


def log_label(log: JobLog, following: bool) -> str:
    """What the log view holds, and where it was cut if it was: the newest lines are shown, the rest downloaded."""
    held = f"{log.matching:,} of {log.total:,} lines hold “{log.search}”" if log.search else f"{log.total:,} lines"
    if log.left_out:
        held += f"; the newest {len(log.shown):,} shown, the {log.left_out:,} before them only in the download"
    return f"Log ({held}{', following' if following else ''})"


@dataclass(frozen=True)
class SampleFilter:
    """What the Samples tab's filter boxes ask for; a box left empty does not filter, and one that cannot be read is
    `refused` with the reason."""

    min_reward: float | None
    max_reward: float | None
    text: str | None
    version: int | None
    all_steps: bool
    page: int = 1
    min_turns: int | None = None
    refused: tuple[str, ...] = ()

    @classmethod
    def read(
        cls,
        min_reward: str,
        max_reward: str,
        search: str,
        version: str,
        all_steps: bool,
        page: float | None = 1,
        turns: str = "",
    ) -> SampleFilter:
        refused: list[str] = []
        low = _number(min_reward, float, "Reward ≥", "a number such as 0.5", refused)
        high = _number(max_reward, float, "Reward ≤", "a number such as 0.5", refused)
        wanted = _number((version or "").strip().lstrip("vV"), int, "Version", "a version such as 12 or v12", refused)
        if wanted is not None and wanted < 0:
            refused.append(f"Version: “{version}” is not a version; type one such as 12 or v12.")
        min_turns = _number(turns, int, "Episode turns ≥", "a number of turns such as 3", refused)
        if min_turns is not None and min_turns < 1:
            refused.append(f"Episode turns ≥: “{turns}” is below 1; type 1 (every agent episode) or more.")
        text = (search or "").strip() or None
        page_number = max(1, int(page or 1))
        return cls(low, high, text, wanted, bool(all_steps), page_number, min_turns, tuple(refused))

    def query(self, step: int) -> SampleFilters:
        """The listing's filters: the step picked, or every step."""
        step_from, step_to = (None, None) if self.all_steps else (step, step)
        return SampleFilters(
            step_from, step_to, self.min_reward, self.max_reward, self.text, self.version, self.min_turns
        )


Number = TypeVar("Number", int, float)


def _number(text: str | None, kind: type[Number], box: str, example: str, refused: list[str]) -> Number | None:
    """The number typed in a filter box, None when it is empty; one that is not a number is added to `refused`."""
    text = (text or "").strip()
    if not text:
        return None
    try:
        value = kind(text)
    except ValueError:
        refused.append(f"{box}: “{text}” is not {example.split(' such')[0]}; type {example}.")
        return None
    if isinstance(value, float) and not math.isfinite(value):
        refused.append(f"{box}: “{text}” is not a finite number; type {example}.")
        return None
    return value


def keep_charts() -> gr.BrowserState:
    """The chart controls, kept in this browser: a reload (or another day) opens the charts as they were. Made outside
    the page's tab: Gradio mounts a tab's components when it is first opened, and an unmounted one loads nothing. A
    fixed key rather than a fresh one per server: the choices are not secret, and survive a restarted panel."""
    return gr.BrowserState(dict(CHART_DEFAULTS), storage_key=CHART_STORAGE_KEY, secret=CHART_STORAGE_KEY)


def remember_charts(smoothing: float, log_y: bool, x_axis: str, more_metrics: list[str] | None) -> SavedCharts:
    """What the browser keeps of the chart controls (CHART_DEFAULTS's keys)."""
    return {"smoothing": smoothing, "log_y": log_y, "x_axis": x_axis, "more_metrics": list(more_metrics or [])}


def _chart_options(services: PanelServices, run_id: str, smoothing: float, log_y: bool, x_axis: str) -> ChartOptions:
    """The Training tab's chart controls as figure options; another x axis than the step is read for the run."""
    options = ChartOptions(int(smoothing or 0), bool(log_y))
    if x_axis == "wall time":
        seconds = services.queries.step_axis(run_id, x_axis)
        values, title = elapsed_axis(list(seconds.values()), "the first step")
        return replace(options, x_values=dict(zip(seconds, values, strict=True)), x_title=title)
    if x_axis == "generated tokens":
        tokens = services.queries.step_axis(run_id, x_axis)
        return replace(options, x_values=tokens, x_title="completion tokens generated")
    return options


def _current_step(services: PanelServices, run: Run) -> int | None:
    """The optimizer step the run's current adapter version holds (None before the first version is listed)."""
    if run.current_version is None:
        return None
    try:
        return services.adapters.version(run.id, run.current_version).step
    except VersionNotFound:  # CURRENT was read before the version's manifest
        return None


def _constant(value: str) -> Callable[[], str]:
    """A handler that returns `value` (a closure per sub-tab: which one is visible now)."""
    return lambda: value


def _shortened(text: str, limit: int) -> str:
    return text[:limit] + ("…" if len(text) > limit else "")


def _samples_table(rows: list[RolloutSample]) -> pd.DataFrame:
    def scores(sample: RolloutSample) -> str:
        return ", ".join(f"{k} {v:.2f}" for k, v in sample.rewards.items() if isinstance(v, int | float))

    return pd.DataFrame(
        [
            {
                "step": s.step,
                "group": s.group_id,
                "reward": round(s.reward, 3) if s.reward is not None else None,
                "advantage": round(s.advantage, 3),
                "version": f"v{s.policy_version}" + (" (dropped)" if s.dropped else ""),
                "staleness": s.staleness,
                "scores": scores(s),
                "prompt": _shortened(s.prompt, 100),
                "completion": _shortened(s.completion, 160),
            }
            for s in rows
        ],
        columns=SAMPLE_COLUMNS,
    )
