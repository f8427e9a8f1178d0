"""The whole panel: five pages in tabs, and the wiring between them (open a run, follow a launch, timers).

Only the open page polls: switching tabs turns the Runs, Monitor and Adapters timers on and off, so a panel left on
the Launch page costs nothing, and the background poller (not the page) keeps ingesting every run.
"""

from __future__ import annotations

from collections.abc import Callable

import gradio as gr

from app.events import Updates
from app.pages.account import AccountPage
from app.pages.adapters import AdaptersPage
from app.pages.launch import LaunchPage
from app.pages.monitor import MonitorPage, keep_charts, run_choices
from app.pages.runs import RunsPage, keep_overlay
from app.panel import Panel
from app.public_api import PublicApi, make_private


def build_app(panel: Panel) -> gr.Blocks:
    app: gr.Blocks  # Gradio's `__enter__` is untyped
    # delete_cache: the zips handed out for download leave Gradio's cache after an hour.
    with gr.Blocks(title="Async GRPO control panel", analytics_enabled=False, delete_cache=(1800, 3600)) as app:
        with gr.Row(equal_height=True):
            gr.Markdown(
                "# Async GRPO control panel\nAsynchronous GRPO with LoRA across Hugging Face Jobs — adapters travel "
                "through your bucket, no NCCL.",
                elem_classes="gp-title",
            )
            if panel.space:
                gr.LoginButton(scale=0, min_width=220)
        launch, runs, monitor = LaunchPage(panel), RunsPage(panel), MonitorPage(panel)
        adapters, account = AdaptersPage(panel), AccountPage(panel)
        saved_overlay, saved_charts = keep_overlay(), keep_charts()  # outside the tabs, so loaded on every page load
        with gr.Tabs(selected="launch", elem_id="pages") as tabs:
            with gr.Tab("Launch", id="launch", elem_id="tab-launch") as launch_tab:
                launch.build()
            with gr.Tab("Runs", id="runs", elem_id="tab-runs") as runs_tab:
                runs.build(saved_overlay)
            with gr.Tab("Monitor", id="monitor", elem_id="tab-monitor") as monitor_tab:
                monitor.build(saved_charts)
            with gr.Tab("Adapters", id="adapters", elem_id="tab-adapters") as adapters_tab:
                adapters.build()
            with gr.Tab("Account", id="account", elem_id="tab-account") as account_tab:
                account.build()
        _wire(app, panel, tabs, launch, runs, monitor, adapters, account,
              {"launch": launch_tab, "runs": runs_tab, "monitor": monitor_tab, "adapters": adapters_tab,
               "account": account_tab})  # fmt: skip
        make_private(app)  # the pages' events are the UI's, not an API: the public one is deliberate
        PublicApi(panel).register()
    return app


def _wire(
    app: gr.Blocks,
    panel: Panel,
    tabs: gr.Tabs,
    launch: LaunchPage,
    runs: RunsPage,
    monitor: MonitorPage,
    adapters: AdaptersPage,
    account: AccountPage,
    tab_of: dict[str, gr.Tab],
) -> None:
    timer_of = {"runs": runs.timer, "monitor": monitor.timer, "adapters": adapters.timer}
    timers = list(timer_of.values())

    def _timers(page: str) -> Updates:
        """Only the open page's timer runs."""
        return {timer: gr.Timer(active=page == name) for name, timer in timer_of.items()}

    def _opened(page: str) -> Callable[[], Updates]:
        return lambda: _timers(page)

    def navigate(run_id: str, profile: gr.OAuthProfile | None = None) -> Updates:
        """Open `run_id` in the monitor."""
        choices = run_choices(panel.services_or_none(profile))
        return {tabs: gr.Tabs(selected="monitor"), monitor.run: gr.Dropdown(choices=choices, value=run_id)} | _timers(
            "monitor"
        )

    nav_outputs = [tabs, monitor.run, *timers]
    launch.wire_launch(navigate, nav_outputs)

    # Opening a page: turn on only its timer. One queue slot for every tab's answer, so the answers come in the order
    # of the clicks: a timer step chained after a page's slower refresh answered late, and the Launch tab's (selected
    # on page load) turned the Monitor's timer off after a quick click on Monitor, leaving its page frozen.
    for name, tab in tab_of.items():
        tab.select(_opened(name), None, timers, concurrency_id="open-page", concurrency_limit=1, show_progress="hidden")
    # ... and refresh what it lists.
    tab_of["launch"].select(launch.on_open, launch.load_outputs(), launch.load_outputs())
    tab_of["runs"].select(runs.refresh_now, runs.overlay_controls(), runs.refresh_outputs())
    # A new run in the dropdown redraws through its change event; the same run is kept current by the timer.
    opened = [monitor.run, monitor.saved_charts]
    tab_of["monitor"].select(monitor.open, opened, monitor.open_outputs(), show_progress="hidden")
    tab_of["adapters"].select(adapters.open, [monitor.run, adapters.run], [adapters.run, adapters.branch_id])
    tab_of["account"].select(account.refresh, None, account.refresh_outputs())

    # Runs page actions that lead elsewhere.
    runs.open_button.click(navigate, [runs.selected], nav_outputs)
    runs.launch_button.click(runs.launch_draft, [runs.selected], [runs.selected]).then(
        navigate, [runs.selected], nav_outputs
    )
    child = gr.State(None)

    def follow_branch(run_id: str | None, started: bool, profile: gr.OAuthProfile | None = None) -> Updates:
        return navigate(run_id, profile) if run_id and started else {}

    runs.branch_button.click(
        runs.branch, [runs.selected, runs.branch_version, runs.branch_id, runs.branch_now], [child]
    ).then(follow_branch, [child, runs.branch_now], nav_outputs).then(
        runs.refresh_now, runs.overlay_controls(), runs.refresh_outputs()
    )

    # A branch from the Adapters page: show it in Runs, overlaid on its parent.
    def show_branch(run_id: str, parent_id: str, profile: gr.OAuthProfile | None = None) -> Updates:
        return (
            {tabs: gr.Tabs(selected="runs")} | _timers("runs") | runs.refresh_now([parent_id, run_id], profile=profile)
        )

    adapters.branch_button.click(
        adapters.branch, [adapters.run, adapters.version, adapters.branch_id, adapters.branch_now], [child]
    ).then(show_branch, [child, adapters.run], [tabs, *timers, *runs.refresh_outputs()])

    # Every page load: (in a Space) the signed-in user's token for their Jobs. The Launch form's credentials and run
    # id come from its tab's select, which Gradio fires on load for the first tab: a second `on_open` here answered
    # after a user (or a test) had typed a run id, and replaced it with a fresh proposal.
    app.load(account.refresh, None, account.refresh_outputs())
    # ... and the choices this browser made last time (kept in its local storage): the Monitor's chart controls (also
    # set by opening the Monitor, with the run it draws) and the Runs page's overlay.
    app.load(monitor.restore_charts, [monitor.saved_charts], monitor.chart_controls(), show_progress="hidden")
    app.load(runs.restore, [runs.saved_overlay], [*runs.refresh_outputs(), runs.smoothing], show_progress="hidden")
