"""What a user meets on the second day: fresh run ids, and errors that stay where they belong.

Before, the Launch page's default id was fixed when the server started: after a first launch, a reloaded page passed
Check settings with that id and Launch then said it was taken; publishing without a token showed its error in a
toast that faded while the last success message stayed.
"""

from __future__ import annotations

import re
import time

import gradio as gr
import pytest

from app.launch_form import FORM
from app.pages.launch import LaunchPage
from app.panel import Panel
from backend.context import PanelContext
from backend.database.connection import Database
from backend.launch.preflight import run_preflight
from backend.services import runs as run_service
from backend.services.runs import RunService, RunStateError, propose_run_id, run_id_taken
from jobs.demo.preset import demo_spec


@pytest.fixture
def panel(tmp_path):
    ctx = PanelContext(Database(tmp_path / "panel.sqlite3"), tmp_path / "panel")
    yield Panel(ctx, space=False)
    ctx.db.close()


def _record(panel: Panel, run_id: str, owner: str = "local") -> None:
    RunService(panel.ctx, owner).create(demo_spec(run_id, f"file://{panel.ctx.folder / 'store'}"))


def test_check_settings_names_a_run_id_that_another_run_has(panel):
    _record(panel, "demo-taken", owner="someone-else")
    spec = demo_spec("demo-taken", f"file://{panel.ctx.folder / 'store'}").model_dump()
    result = run_preflight(panel.ctx, "local", spec)
    assert not result.ok and "is taken by another run" in result.errors["run_id"]
    routed = FORM.route_errors(result.errors, FORM.spec_from_form(FORM.form_from_spec(spec)), code_enabled=False)
    assert [text for text in routed["run"] if "taken" in text] == [f"Run id: {result.errors['run_id']}"]
    with pytest.raises(RunStateError, match="is taken"):
        _record(panel, "demo-taken")
    free = run_preflight(panel.ctx, "local", {**spec, "run_id": "demo-free"})
    assert "run_id" not in free.errors


def test_a_proposed_id_is_free_even_when_that_seconds_id_is_taken(panel, monkeypatch):
    monkeypatch.setattr(run_service.time, "strftime", lambda _: "1202-073000")
    assert propose_run_id(panel.ctx, "demo") == "demo-1202-073000"
    _record(panel, "demo-1202-073000")
    _record(panel, "demo-1202-073000-2")
    proposal = propose_run_id(panel.ctx, "demo")
    assert proposal == "demo-1202-073000-3" and not run_id_taken(panel.ctx, proposal)


def test_opening_the_launch_page_replaces_an_id_a_run_has_taken_and_keeps_a_free_one(panel):
    page = LaunchPage(panel)
    with gr.Blocks():
        page.build()
    run_id_box = page.inputs["run_id"]
    shown = page.initial["run_id"]
    assert shown.startswith("demo-") and not run_id_taken(panel.ctx, shown)
    assert run_id_box not in page.on_open("", "", "", shown, None)  # still free: what is on screen stays
    _record(panel, shown)  # launched (here, or in another tab)
    fresh = page.on_open("", "", "", shown, None)[run_id_box]
    assert fresh != shown and fresh.startswith("demo-") and not run_id_taken(panel.ctx, fresh)
    assert page.on_open("", "", "", "", None)[run_id_box].startswith("run-")  # an emptied box gets one too


@pytest.fixture
def whole_panel(panel):
    from app.ui import build_app

    app = build_app(panel)
    yield app
    app.close()


def _pages(app: gr.Blocks) -> list[int]:
    """The panel's pages: the tabs of its top-level Tabs (the Monitor's sub-tabs are not pages)."""
    (pages,) = [block for block in app.blocks.values() if isinstance(block, gr.Tabs) and block.elem_id == "pages"]
    return [tab._id for tab in pages.children]


def test_a_page_load_proposes_the_run_id_once_so_a_typed_id_is_never_replaced(whole_panel):
    """Gradio fires the first tab's select on page load; the load event also ran `on_open`, and its second answer
    replaced a run id the user had typed meanwhile (seen as a flaky browser test). One event serves both."""
    on_open = [fn.targets for fn in whole_panel.fns.values() if fn.name == "on_open"]
    assert on_open == [[(_pages(whole_panel)[0], "select")]]


def test_the_open_pages_timer_follows_the_last_tab_clicked(whole_panel):
    """A timer step chained after a page's own refresh answered late: the Launch tab's, selected on page load, turned
    the Monitor's timer off after a quick click on Monitor, and the Monitor froze (a flaky browser test, twice). Each
    tab now answers its timers directly, all through one queue slot, so the answers keep the order of the clicks."""
    timers = {id(timer) for timer in whole_panel.blocks.values() if isinstance(timer, gr.Timer)}
    page_timers = [
        fn for fn in whole_panel.fns.values() if fn.outputs and {id(o) for o in fn.outputs} <= timers and fn.targets
    ]
    by_tab = {target: fn for fn in page_timers for target, event in fn.targets if event == "select"}
    assert set(by_tab) == set(_pages(whole_panel))
    assert {(fn.concurrency_id, fn.concurrency_limit) for fn in by_tab.values()} == {("open-page", 1)}
    assert not [fn for fn in whole_panel.fns.values() if fn.trigger_after is not None and fn in page_timers]


def test_the_branch_forms_propose_a_free_id_each_time(panel):
    from app.pages.adapters import AdaptersPage

    page = AdaptersPage(panel)
    with gr.Blocks():
        page.build()
    first = page.open(None, None, None)[page.branch_id]
    _record(panel, first)
    second = page.open(None, None, None)[page.branch_id]
    assert second != first and second.startswith("branch-") and not run_id_taken(panel.ctx, second)


def test_publishing_without_a_token_says_why_where_the_last_result_was_shown(panel):
    """Not a toast that fades beside an old success message: the answer replaces the note under the buttons."""
    from app.pages.adapters import AdaptersPage

    _record(panel, "demo-publish")
    page = AdaptersPage(panel)
    note = page.publish("demo-publish", 1, "me/adapter", True, None)
    assert "Not published: publishing needs an HF token with write access" in note
    assert "Pick a version" in page.publish("demo-publish", None, "me/adapter", True, None)


def test_an_adapter_action_with_nothing_picked_says_so_beside_its_buttons(panel):
    """Issue 18, item 2: not a toast that fades: the note replaces the last outcome shown under the buttons (and a
    Save button left from an earlier download is hidden, so it cannot be taken for this answer)."""
    from app.pages.adapters import AdaptersPage

    _record(panel, "demo-pick")
    page = AdaptersPage(panel)
    with gr.Blocks():
        page.build()
    prepared = page.prepare_download("demo-pick", None)
    assert "Pick a run and a version first" in prepared[page.action] and prepared[page.download].visible is False
    assert "Pick a run and a version first" in page.make_current("demo-pick", None)
    assert "Pick two versions to compare" in page.compare("demo-pick", 1, None)[page.summary]


def test_following_a_finished_run_prints_its_own_pace(panel):
    """`python -m backend follow` on a run that ended: its steps per minute, not steps over a second of watching."""
    import io

    from backend.cli import follow
    from backend.database.models import MetricPoint, Run
    from backend.ingestion.poller import Poller

    _record(panel, "demo-done")
    with panel.ctx.db.session() as session:
        run = session.get(Run, "demo-done")
        run.status, run.step = "finished", 40
        session.add(run)
        session.add_all(
            MetricPoint(run_id="demo-done", owner="local", step=step, name="perf/step_s", value=2.0)
            for step in range(1, 41)
        )
        session.commit()
    out = io.StringIO()
    assert follow(panel.ctx, "demo-done", Poller(panel.ctx), out=out, interval=0.01) == "finished"
    assert " 30.0 steps/min" in out.getvalue()


@pytest.mark.parametrize(
    ("model", "says"),
    [
        ("Qwen/Qwen2.5-0.5B-Instruct", ["base_model: Qwen/Qwen2.5-0.5B-Instruct", "AutoPeftModelForCausalLM"]),
        ("builtin:tiny-qwen2", ["no Hub id", 'builtin_model_folder("builtin:tiny-qwen2")']),
        ("builtin:tiny-agent", ["no Hub id", 'builtin_model_folder("builtin:tiny-agent")']),
        ("/models/my-model", ["local folder, `/models/my-model`, not a Hub id"]),
    ],
)
def test_a_model_card_says_how_to_load_the_adapter_wherever_its_base_model_lives(model, says):
    """Issue 18, item 9: the card names the base model for the Hub only when it has a Hub id, tags what trained it,
    and gives loading code that works for that base model."""
    from backend.services.adapters import model_card
    from jobs.pins import pins

    spec = demo_spec("demo-card", "file:///tmp/store").model_copy(deep=True)
    spec.model.id = model
    card = model_card(spec, 3, 12, {"reward": 0.5, "kl": None})
    assert all(text in card for text in says), card
    front = card.split("---")[1]
    assert ("base_model:" in front) == (model.count("/") == 1 and not model.startswith("/"))
    assert f"TRL {pins()['trl']}, PEFT {pins()['peft']}" in card
    assert "| reward | 0.5000 |" in card and "| kl |" not in card
    assert "adapter version 3, optimizer step 12" in card


def test_samples_are_found_by_text_version_and_reward_across_steps(panel):
    """Issue 18, item 6: the Samples tab searches prompts and completions (literally: `%` is no wildcard) and filters
    by version and reward, in one step or in all of them; a picked row shows its own step's group."""
    from app.pages.monitor import MonitorPage
    from backend.database.models import RolloutSample

    _record(panel, "demo-samples")
    texts = {1: "apple pie", 2: "100% apple", 3: "banana"}
    with panel.ctx.db.session() as session:
        session.add_all(
            RolloutSample(
                run_id="demo-samples",
                owner="local",
                step=step,
                policy_version=step - 1,
                staleness=1,
                group_id=group,
                prompt="Write some numbers.",
                completion=f"{texts[step]} {group}",
                reward=step / 10 + group / 100,
            )
            for step in texts
            for group in (0, 1)
        )
        session.commit()
    page = MonitorPage(panel)
    with gr.Blocks():
        page.build()

    def listed(step: int, *filters) -> list[tuple[int, str]]:
        table = page.browse("demo-samples", step, *filters)[page.samples]
        return list(zip(table["step"], table["completion"], strict=True))

    assert listed(3, "", "", "apple", "", True) == [
        (2, "100% apple 0"),
        (2, "100% apple 1"),
        (1, "apple pie 0"),
        (1, "apple pie 1"),
    ]
    assert listed(3, "", "", "APPLE", "", False) == []  # one step unless All steps: step 3 has no apple
    assert [c for _, c in listed(2, "", "", "0%", "", False)] == ["100% apple 0", "100% apple 1"]
    assert listed(3, "", "", "%", "", True) == [(2, "100% apple 0"), (2, "100% apple 1")]  # literally a percent sign
    assert listed(3, "", "", "", "v0", True) == [(1, "apple pie 0"), (1, "apple pie 1")]
    assert listed(3, "0.205", "", "", "", True) == [(3, "banana 0"), (3, "banana 1"), (2, "100% apple 1")]
    shown = page.browse("demo-samples", 3, "", "", "pie", "", True)
    assert "Best of group 0" in shown[page.best] and "apple pie" in shown[page.best]
    table = shown[page.samples]
    event = gr.SelectData(None, {"index": [1, 0], "value": 1, "selected": True})
    picked = page.pick_group("demo-samples", table, event)
    assert "Best of group 1" in picked[page.best] and "apple pie 1" in picked[page.best]


def test_the_sample_browser_counts_pages_through_every_sample_and_refuses_a_filter_it_cannot_read(panel):
    """Issue 33, item 4: the table held at most 200 rows with no count (step 3 had 232), a version "zzz" or a reward
    bound "abc" listed the unfiltered table without a word, and the prompt a search found was not shown."""
    from app.pages.monitor import SAMPLES_PER_PAGE, MonitorPage
    from backend.database.models import RolloutSample

    _record(panel, "demo-pages")
    with panel.ctx.db.session() as session:
        session.add_all(
            RolloutSample(
                run_id="demo-pages", owner="local", step=3, policy_version=2, staleness=1, group_id=index // 8,
                prompt=f"Prompt {index // 8}: " + "count to ten " * 20, completion=f"c{index}", reward=index / 1000,
                dropped=index % 29 == 0,
            )
            for index in range(232)
        )  # fmt: skip
        session.commit()
    page = MonitorPage(panel)
    with gr.Blocks():
        page.build()

    first = page.browse("demo-pages", 3, "", "", "", "", False)
    assert len(first[page.samples]) == SAMPLES_PER_PAGE == 200
    assert "Samples 1–200 of 232 · page 1 of 2" in first[page.sample_count]
    second = page.browse("demo-pages", 3, "", "", "", "", False, 2)
    assert len(second[page.samples]) == 32 and "Samples 201–232 of 232 · page 2 of 2" in second[page.sample_count]
    listed = [*first[page.samples]["completion"], *second[page.samples]["completion"]]
    assert sorted(listed) == sorted(f"c{index}" for index in range(232))  # every sample once over the two pages
    versions = [*first[page.samples]["version"], *second[page.samples]["version"]]
    assert versions.index("v2 (dropped)") == 224  # trained samples first, dropped ones after: over pages too
    past_the_end = page.browse("demo-pages", 3, "", "", "", "", False, 9)
    assert "Samples 201–232 of 232 · page 2 of 2" in past_the_end[page.sample_count]
    prompt = first[page.samples]["prompt"][0]
    assert prompt.startswith("Prompt ") and prompt.endswith("…") and len(prompt) == 101  # shortened, not left out
    for filters, said in (
        (("", "", "", "zzz", True), "Version: “zzz” is not a version; type a version such as 12 or v12."),
        (("abc", "", "", "", True), "Reward ≥: “abc” is not a number; type a number such as 0.5."),
        (("", "nan", "", "", True), "Reward ≤: “nan” is not a finite number"),
    ):
        refused = page.browse("demo-pages", 3, *filters)
        assert said in refused[page.sample_count] and refused[page.samples].empty, filters
    both = page.browse("demo-pages", 3, "abc", "", "", "zzz", True)[page.sample_count]
    assert "Reward ≥" in both and "Version" in both  # every box that cannot be read, in one pass
    assert "Samples 1–1 of 1" in page.browse("demo-pages", 3, "0.231", "", "", "v2", True)[page.sample_count]


def test_the_account_page_keeps_only_tokens_the_hub_accepts_and_asks_before_deleting(panel, tmp_path):
    """Issue 18, item 7: a token is shown to the Hub (whoami) before it is kept; the Hub's answer (its user and
    access) is shown; offline, a token-shaped value is kept unchecked and the page says so; deleting asks first."""
    from app.pages.account import AccountPage
    from tests.support.hub_emulator import HubEmulator

    good = "hf_accountgood0123456789abcdefgh"
    hub = HubEmulator(tmp_path / "hub", tokens=(good,), namespace="tester").start()
    page = AccountPage(panel)
    with gr.Blocks():
        page.build()
    saved = lambda: [c.name for c in panel.ctx.vault.list("local")]  # noqa: E731
    try:
        panel.ctx.hub_endpoint = hub.url
        shown = page.save_token("typo", "not-a-token")
        assert "Not saved" in shown[page.result] and "start with &#x27;hf_&#x27;" in shown[page.result]
        shown = page.save_token("revoked", "hf_revoked0123456789abcdefghijkl")
        assert "The Hub refused this token" in shown[page.result] and saved() == []
        shown = page.save_token("mine", good)
        assert "user tester, write access" in shown[page.result] and saved() == ["mine"]
    finally:
        hub.close()
    panel.ctx.hub_endpoint = "http://127.0.0.1:9"  # nothing listens there: the Hub cannot be reached
    shown = page.save_token("offline", "hf_offline0123456789abcdefghijkl")
    assert "unchecked: the Hub could not be reached" in shown[page.result] and saved() == ["mine", "offline"]
    assert good not in repr(shown)

    (mine,) = [c.id for c in panel.ctx.vault.list("local") if c.name == "mine"]
    asked = page.ask_delete(mine)
    assert asked[page.confirm_row].visible is True and "Delete mine" in asked[page.confirm_text]
    assert saved() == ["mine", "offline"]  # nothing goes before the second click
    done = page.delete(mine)
    assert done[page.confirm_row].visible is False and "Deleted" in done[page.result] and saved() == ["offline"]
    assert page.ask_delete(None)[page.confirm_row].visible is False


def test_an_unreachable_hub_is_found_in_one_request_and_says_what_went_unchecked(panel):
    """Issue 18, item 10: offline, preflight used to spend ~25 s in the dataset loader's retries alone. Now one
    request finds the Hub down: a Hub model and dataset are recorded as not checked, and HF Jobs (submitted through
    the Hub) are refused. Issue 33, item 2: local jobs, which share the panel's network, are refused too, on the
    model and dataset fields (launched, such a run failed a minute later, after both replicas had started)."""
    import socket
    import threading

    from backend.launch import presets

    listener = socket.create_server(("127.0.0.1", 0))
    connections = []

    def reset_every_connection() -> None:  # a Hub that drops every connection, as a broken network does
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            connections.append(connection)
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            connection.close()

    threading.Thread(target=reset_every_connection, daemon=True).start()
    panel.ctx.hub_endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        spec = presets.math_recipe("offline-hub", "someone", "grpo")
        result = run_preflight(panel.ctx, "local", spec)
        local = {**spec, "run_id": "offline-local", "compute": {"backend": "local", "replicas": 1}}
        local["storage"] = {"uri": f"file://{panel.ctx.folder / 'store'}"}
        on_this_machine = run_preflight(panel.ctx, "local", local)
    finally:
        listener.close()
    assert len(connections) == 2  # one request each
    assert set(result.unchecked) == {"model", "dataset", "rewards"}
    assert "Qwen/Qwen2.5-Math-1.5B" in result.unchecked["model"] and "did not answer" in result.unchecked["model"]
    assert spec["dataset"]["id"] in result.unchecked["dataset"]
    assert "HF Jobs are submitted through it" in result.errors["compute.backend"]
    assert "dataset.id" not in result.errors and "model.id" not in result.errors
    assert not on_this_machine.ok and "compute.backend" not in on_this_machine.errors
    for field in ("model.id", "dataset.id"):
        assert "local jobs share this machine's network" in on_this_machine.errors[field], field
    assert "is not cached in" not in str(on_this_machine.errors)


def test_a_check_that_could_not_run_is_shown_not_checked_never_passed():
    """Issue 33, item 2: offline, Check settings said "All checks passed: bucket, dataset, rewards and compute" and
    only in small print that the dataset and rewards had not been checked."""
    from app.pages.launch import check_status
    from backend.launch.preflight import Preflight
    from jobs.contract import RunSpec

    spec = RunSpec(run_id="hub-run")
    passed = check_status(Preflight(spec=spec, warnings=["2 replicas on 2 cores will be slow"]))
    assert "All checks passed: bucket, model, dataset, rewards, compute" in passed and "gp-note-good" in passed
    assert "Note: 2 replicas on 2 cores will be slow" in passed
    unchecked = Preflight(spec=spec, unchecked={"model": "Qwen/Qwen2.5-Math-1.5B: the Hub did not answer"})
    shown = check_status(unchecked)
    assert "All checks passed" not in shown and "gp-note-warn" in shown
    assert "Not checked: model: Qwen/Qwen2.5-Math-1.5B: the Hub did not answer" in shown
    assert "Passed: bucket, dataset, rewards, compute" in shown
    failed = check_status(Preflight(spec=spec, errors={"model.id": "x"}))
    assert "1 problem to fix" in failed and "gp-note-bad" in failed


def test_the_chart_controls_change_what_the_training_figures_plot():
    """Issue 18, item 4: the smoothing window is the reader's (automatic by default, off at 1) and the raw reward stays
    drawn beside the smoothed one; the log scale applies to the y axis; smoothed curves say they are."""
    from app.charts.style import ChartOptions
    from app.charts.training import reward_figure, reward_functions_figure, step_time_figure

    series = [(step, float(step)) for step in range(1, 41)]
    automatic = reward_figure(series)
    assert [trace.name for trace in automatic.data] == ["per step", "rolling mean (5 steps)"]
    assert list(automatic.data[0].y) == [float(step) for step in range(1, 41)]
    chosen = reward_figure(series, ChartOptions(smoothing=10, log_y=True))
    assert chosen.data[1].name == "rolling mean (10 steps)" and chosen.data[1].y[-1] == pytest.approx(35.5)
    assert chosen.layout.yaxis.type == "log" and automatic.layout.yaxis.type is None
    assert [trace.name for trace in reward_figure(series, ChartOptions(smoothing=1)).data] == ["per step"]
    functions = reward_functions_figure({"digit_frac": series}, ChartOptions(smoothing=8))
    assert functions.layout.yaxis.title.text == "score, rolling mean (8 steps)"
    assert [trace.name for trace in functions.data] == ["digit_frac per step", "digit_frac"]  # the raw stays drawn
    assert functions.data[0].y[-1] == 40.0 and functions.data[1].y[-1] == pytest.approx(36.5)
    assert step_time_figure(series, series, [], [], ChartOptions(log_y=True)).layout.yaxis.type == "log"


def test_the_routing_figure_counts_time_in_a_unit_that_suits_the_run():
    """Issue 18, item 4: a one-minute run's routing shares were plotted at 0.333, 0.5 and 0.667 minutes."""
    from app.charts.replicas import routing_figure

    def snapshots(every: float, count: int) -> list[dict]:
        return [
            {"time": 1000.0 + every * i, "started": 1000.0, "routing": {"routed": 10 * i, "affinity": 9 * i}}
            for i in range(count)
        ]

    short = routing_figure(snapshots(10.0, 7))
    assert short.layout.xaxis.title.text == "seconds since the proxy started"
    assert list(short.data[0].x) == [10.0, 20.0, 30.0, 40.0, 50.0, 60.0]
    assert short.data[0].y[0] == pytest.approx(90.0)
    long = routing_figure(snapshots(600.0, 4))
    assert long.layout.xaxis.title.text == "minutes since the proxy started" and list(long.data[0].x) == [10, 20, 30]


def test_the_header_says_which_step_the_current_version_holds(panel):
    """Issue 18, item 10: v1 is the weights before the first step, so the header's "step 40" and "current v41"
    looked like a disagreement; the version now says the step it holds."""
    from app import cards
    from backend.services.runs import RunService

    _record(panel, "demo-header")
    run = RunService(panel.ctx, "local").get("demo-header")
    run.step, run.current_version, run.best_version = 40, 41, 38
    header = cards.run_header(run, None, current_step=40)
    assert "current v41 (step 40) · best v38" in header
    assert "current v41 · best v38" in cards.run_header(run, None)  # the version not listed yet: no step claimed


def test_time_left_is_estimated_from_timed_steps_not_from_the_start_up(panel):
    """Issue 33, item 7: "time left 42m 39s" at step 1 of a run that ended 2.5 minutes later. Step 1 waits for the
    rollout worker to start; the estimate waits for two steps after it, and follows their pace."""
    from app import cards
    from backend.database.models import MetricPoint
    from backend.services.queries import QueryService
    from jobs.contract import duration

    _record(panel, "demo-eta")
    queries = QueryService(panel.ctx, "local")

    def timed(step: int, seconds: float) -> str:
        with panel.ctx.db.session() as session:
            session.add(MetricPoint(run_id="demo-eta", owner="local", step=step, name="perf/step_s", value=seconds))
            session.commit()
        run = RunService(panel.ctx, "local").get("demo-eta")
        run.status, run.step, run.max_steps, run.started_at = "running", step, 40, time.time() - 70
        header = cards.run_header(run, queries.step_seconds("demo-eta"))
        return re.search(r"<span>time left</span><b>([^<]*)</b>", header).group(1)

    assert timed(1, 64.0) == "estimating…"  # the start-up, not the pace
    assert timed(2, 3.0) == "estimating…"
    assert timed(3, 3.4) == duration(37 * 3.2)
    assert timed(4, 60.0) == duration(36 * 3.4)  # one slow step (a resume's start-up) moves the median, not the mean


def test_the_header_says_what_share_of_the_generated_samples_was_trained_on(panel):
    """Issue 33, item 5: 53 % of a demo's samples were dropped as too stale, and nothing on the Monitor said so."""
    from app import cards
    from backend.database.models import RolloutSample
    from backend.services.queries import QueryService

    _record(panel, "demo-use")
    queries = QueryService(panel.ctx, "local")
    run = RunService(panel.ctx, "local").get("demo-use")
    assert "<span>trained on</span><b>—</b>" in cards.run_header(run, None, sample_use=queries.sample_use(run.id))
    with panel.ctx.db.session() as session:
        for index in range(8):
            session.add(
                RolloutSample(
                    run_id="demo-use", owner="local", step=2, policy_version=2 - (index < 2) * 2,
                    staleness=(index < 2) * 2, group_id=0, prompt="p", completion="c", dropped=index < 2,
                )
            )  # fmt: skip
        session.commit()
    use = queries.sample_use(run.id)
    assert (use.pulled, use.trained, use.trained_share) == (8, 6, 0.75)
    # The Rollouts tab's samples-per-version figure counts them the same way (it read any number dropped as 1).
    assert [(v.policy_version, v.samples, v.dropped) for v in queries.sample_versions(run.id)] == [(0, 2, 2), (2, 6, 0)]
    header = cards.run_header(run, None, sample_use=use)
    assert "<span>trained on</span><b>75% of samples</b>" in header
    assert "6 of the 8 samples the trainer took; the rest were too stale" in header


def test_the_runs_page_overlays_any_logged_metric_with_branches_from_their_fork(panel):
    """Issue 18, item 4: the Runs page compares any metric the ticked runs logged, not only the reward; a branch's
    curve starts at the step its parent version was published at."""
    from app.pages.runs import RunsPage
    from backend.database.models import AdapterVersion, MetricPoint, Run

    _record(panel, "demo-parent")
    _record(panel, "demo-child")
    with panel.ctx.db.session() as session:
        child = session.get(Run, "demo-child")
        child.parent_run_id, child.parent_version = "demo-parent", 7
        session.add(child)
        session.add(AdapterVersion(run_id="demo-parent", owner="local", version=7, step=6, created_at=0.0))
        for run_id, steps in (("demo-parent", 10), ("demo-child", 4)):
            session.add_all(
                MetricPoint(run_id=run_id, owner="local", step=step, name=name, value=step / 100)
                for step in range(1, steps + 1)
                for name in ("reward", "kl")
            )
        session.commit()
    page = RunsPage(panel)
    with gr.Blocks():
        page.build()
    shown = page.refresh_now(["demo-parent", "demo-child"], "kl")
    figure = shown[page.overlay]
    assert "kl of the ticked runs" in figure.layout.title.text and figure.layout.yaxis.title.text == "kl"
    lines = [trace for trace in figure.data if trace.mode != "markers"]
    assert [list(trace.x) for trace in lines] == [list(range(1, 11)), [7, 8, 9, 10]]
    assert shown[page.metric].choices == [("kl", "kl"), ("reward", "reward")]
    again = page.refresh(["demo-parent", "demo-child"], shown[page.drawn], "kl")
    assert again[page.overlay] == gr.skip()  # nothing moved on: the overlay is left as drawn
    # Issue 33, item 3: the overlay's own smoothing (it was always a rolling mean), and a reload restores it all.
    raw = page.refresh_now(["demo-parent"], "kl", 1)[page.overlay]
    assert "not smoothed" in raw.layout.title.text
    assert list(raw.data[0].y) == pytest.approx([s / 100 for s in range(1, 11)])
    wide = page.refresh_now(["demo-parent"], "kl", 4)[page.overlay]
    assert list(wide.data[0].y)[3] == pytest.approx(sum(range(1, 5)) / 400)
    from app.pages.runs import remember_overlay

    restored = page.restore(remember_overlay(["demo-child", "gone-run"], "kl", 4))
    assert restored[page.compare].value == ["demo-child"] and restored[page.metric].value == "kl"
    assert restored[page.smoothing] == 4
    assert list(restored[page.overlay].data[0].y)[3] == pytest.approx(sum(range(1, 5)) / 400)  # its own 4 steps
    assert page.restore(None)[page.metric].value == "reward"  # a browser that kept nothing: the defaults


def test_the_monitor_charts_any_logged_metric_and_a_reload_keeps_the_choice(panel):
    """Issue 33, item 3: all 67 TRL metrics were ingested but the Monitor drew a fixed set."""
    from app.pages.monitor import CHART_DEFAULTS, MonitorPage, remember_charts
    from backend.database.models import MetricPoint

    _record(panel, "demo-more")
    with panel.ctx.db.session() as session:
        session.add_all(
            MetricPoint(run_id="demo-more", owner="local", step=step, name=name, value=step * scale)
            for step in range(1, 9)
            for name, scale in (("loss", 0.1), ("grad_norm", 2.0), ("entropy", 1.0))
        )
        session.commit()
    page = MonitorPage(panel)
    with gr.Blocks():
        page.build()
    shown = page.refresh("demo-more", "training", {}, 1, True, "", "", "", "", False, 1, "", 1, True, "step", ["loss"])
    assert {"loss", "grad_norm", "entropy"} <= set(dict(shown[page.more_metrics].choices))
    figure = shown[page.more_plot]
    assert len(figure.data) == 1 and list(figure.data[0].y) == [step * 0.1 for step in range(1, 9)]
    assert figure.layout.yaxis.type == "log" and figure.layout.yaxis.title.text == "loss"
    two = page.refresh(
        "demo-more", "training", {}, 1, True, "", "", "", "", False, 1, "", 3, False, "step", ["loss", "grad_norm"]
    )
    assert len(two[page.more_plot].data) == 4  # each metric per step and its rolling mean, in its own chart
    assert two[page.more_plot].layout.yaxis2.title.text == "grad_norm"
    saved = remember_charts(3, True, "wall time", ["grad_norm"])
    restored = page.restore_charts(saved)
    assert [restored[c] for c in (page.smoothing, page.log_y, page.x_axis)] == [3, True, "wall time"]
    assert restored[page.more_metrics].value == ["grad_norm"]
    defaults = page.restore_charts(None)
    assert defaults[page.smoothing] == CHART_DEFAULTS["smoothing"] and defaults[page.more_metrics].value == []
    # Opening the Monitor picks the run and sets the controls in one answer, so the run's first drawing has them.
    opened = page.open(None, saved)
    assert opened[page.run].value == "demo-more" and opened[page.more_metrics].value == ["grad_norm"]
    assert set(opened) == set(page.open_outputs())


def test_the_training_figures_count_x_in_wall_time_or_generated_tokens(panel):
    """Issue 18, item 4: the x axis of the training figures counts steps, wall time or generated tokens, read for the
    run: time from when each step was logged, tokens as each step's samples times their mean length, summed."""
    from app.charts.style import ChartOptions
    from app.charts.training import ratio_kl_figure, reward_figure
    from app.pages.monitor import _chart_options
    from backend.api import PanelServices
    from backend.database.models import MetricPoint

    _record(panel, "demo-axes")
    rows = []
    for step in range(1, 5):
        at = 1000.0 + 30.0 * step
        rows += [
            MetricPoint(run_id="demo-axes", owner="local", step=step, name="reward", value=0.1 * step, time=at),
            MetricPoint(
                run_id="demo-axes", owner="local", step=step, name="completions/mean_length", value=10.0 + step
            ),
            MetricPoint(run_id="demo-axes", owner="local", step=step, name="batch/samples_per_step", value=64.0),
        ]
    with panel.ctx.db.session() as session:
        session.add_all(rows)
        session.commit()
    services = PanelServices(panel.ctx, "local")
    assert services.queries.step_axis("demo-axes", "wall time") == {1: 0.0, 2: 30.0, 3: 60.0, 4: 90.0}
    assert services.queries.step_axis("demo-axes", "generated tokens") == {1: 704.0, 2: 1472.0, 3: 2304.0, 4: 3200.0}
    reward = services.queries.metric_series("demo-axes", "reward")

    by_time = reward_figure(reward, _chart_options(services, "demo-axes", 0, False, "wall time"))
    assert list(by_time.data[0].x) == [0.0, 30.0, 60.0, 90.0]
    assert by_time.layout.xaxis.title.text == "seconds since the first step"
    by_tokens = _chart_options(services, "demo-axes", 0, False, "generated tokens")
    assert list(reward_figure(reward, by_tokens).data[1].x) == [704.0, 1472.0, 2304.0, 3200.0]
    ratio = ratio_kl_figure(reward, reward, options=ChartOptions(log_y=True, x_values={1: 5.0}, x_title="t"))
    assert ratio.layout.yaxis.type is None and list(ratio.data[0].x) == [5.0, None, None, None]
    assert _chart_options(services, "demo-axes", 0, False, "step") == ChartOptions()


def test_a_tick_that_changes_nothing_says_so_in_a_form_gradio_accepts(panel):
    """Gradio reads an empty dict as one output value and fails the event ("didn't return enough output values"),
    which a browser test met in CI on the Adapters page's timer: "nothing changed" must name an output, skipped."""
    from app.pages.adapters import AdaptersPage
    from app.pages.monitor import MonitorPage

    _record(panel, "demo-tick")
    adapters, monitor = AdaptersPage(panel), MonitorPage(panel)
    with gr.Blocks():
        adapters.build()
        monitor.build()
    listed = adapters.show_run("demo-tick")[adapters.listed]
    for answer, outputs in (
        (adapters.refresh("demo-tick", listed), adapters._listing_outputs()),
        (adapters.refresh(None, None), adapters._listing_outputs()),
        (monitor.browse("", 1, "", "", "", "", True), [monitor.samples, monitor.best, monitor.worst]),
    ):
        assert answer and set(answer) <= set(outputs), answer
        assert all(value == gr.skip() for value in answer.values()), answer


def test_a_failed_run_says_its_failure_once(panel):
    """Issue 33, item 2: a run's failure was shown three times: under the header, in the banner and as an alert."""
    from app.pages.monitor import MonitorPage
    from backend.database.models import Event, Run

    _record(panel, "demo-failed")
    failure = "dataset.id: could not load 'openai/gsm8k': the Hub did not answer"
    with panel.ctx.db.session() as session:
        run = session.get(Run, "demo-failed")
        run.status, run.status_message = "failed", failure
        session.add(run)
        for kind, message in (("job_error", f"trainer: {failure}"), ("replica_lag", "replica-1 is 3 versions behind")):
            session.add(Event(run_id="demo-failed", owner="local", time=time.time(), level="error", kind=kind,
                              message=message))  # fmt: skip
        session.commit()
    page = MonitorPage(panel)
    with gr.Blocks():
        page.build()
    shown = page.refresh("demo-failed", "training", {}, 1, True, "", "", "", "", False)
    banner = shown[page.alerts].value
    assert failure not in shown[page.header]
    assert banner.count("could not load") == 1 and "The run failed: dataset.id" in banner
    assert "replica-1 is 3 versions behind" in banner  # another alert is still shown


def test_the_alerts_say_their_step_and_dismiss_shows_only_with_an_alert_in_force(panel):
    """Issue 33, item 9: the alerts table's "at" column was empty for events the panel records (a stop, a launch
    failure), and "Alert in force" with its Dismiss button showed with nothing to dismiss."""
    from app.pages.monitor import MonitorPage
    from backend.database.models import Run
    from backend.ingestion.events import record_event

    _record(panel, "demo-alerts")
    page = MonitorPage(panel)
    with gr.Blocks():
        page.build()

    def jobs_tab() -> dict:
        return page._jobs(panel.services(None), RunService(panel.ctx, "local").get("demo-alerts"))

    quiet = jobs_tab()
    assert quiet[page.alert_pick].visible is False and quiet[page.dismiss_button].visible is False
    with panel.ctx.db.session() as session:
        run = session.get(Run, "demo-alerts")
        run.step = 12
        session.add(run)
        session.commit()
    record_event(panel.ctx.db, "demo-alerts", "local", "job_error", "replica-0 ran out of memory", "error")
    raised = jobs_tab()
    assert raised[page.alert_pick].visible is True and raised[page.dismiss_button].visible is True
    assert "<td>step 12</td>" in raised[page.alert_list]


def test_a_branch_cannot_be_asked_for_before_a_version_is_picked(panel):
    """Issue 33, item 9: the primary "Train a branch from here" button was lit with no run or version selected."""
    from app.pages.adapters import AdaptersPage, _version_picked

    page = AdaptersPage(panel)
    with gr.Blocks():
        page.build()
    assert page.branch_button.interactive is False
    assert _version_picked(None)[1].interactive is False and _version_picked("")[1].interactive is False
    assert _version_picked("v3")[1].interactive is True
