"""Held-out scores written during a run (telemetry stream `eval`, issue 29): ingested exactly once, read back per
version and as the best version, and shown on the Monitor (its own chart, the header) and the Adapters page."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gradio as gr
import pytest
from sqlmodel import col, select

from app import cards
from app.charts.style import ChartOptions
from app.charts.training import held_out_figure
from app.pages.adapters import HELD_OUT_COLUMN, AdaptersPage
from app.pages.monitor import MonitorPage
from app.panel import Panel
from backend.context import PanelContext
from backend.database.connection import Database
from backend.database.models import AdapterVersion, Run, VersionScore
from backend.ingestion import alerts, ingest
from backend.ingestion.poller import Poller
from backend.services.queries import HeldOutScore, QueryService
from backend.services.runs import RunNotFound, RunService
from jobs.contract import layout
from jobs.demo.preset import demo_spec
from jobs.store import LocalStore
from jobs.telemetry import ChunkWriter, encode_jsonl

RUN = "demo-eval"
KEY = "0123456789abcdef"


@pytest.fixture
def panel(tmp_path: Path) -> Iterator[Panel]:
    ctx = PanelContext(Database(tmp_path / "panel.sqlite3"), tmp_path / "panel")
    RunService(ctx, "local").create(demo_spec(RUN, f"file://{tmp_path / 'store'}"))
    yield Panel(ctx, space=False)
    ctx.db.close()


def record(version: int, mean: float, half: float | None = 0.05, key: str = KEY, **scores: float) -> dict[str, Any]:
    """An eval record as the evaluator writes it: the total reward, and `scores` as rewards/<name>."""

    def score(value: float) -> dict[str, float | None]:
        low, high = (None, None) if half is None else (value - half, value + half)
        return {"mean": value, "low": low, "high": high, "pass_at_k": None}

    named = {f"rewards/{name}": score(value) for name, value in scores.items()}
    return {
        "time": time.time(),
        "attempt": 1,
        "version": version,
        "step": max(version - 1, 0),
        "key": key,
        "prompts": 32,
        "k": 4,
        "seconds": 3.1,
        "scores": {"reward": score(mean), **named},
    }


def scores(ctx: PanelContext) -> list[tuple[int, str, float]]:
    with ctx.db.session() as session:
        rows = session.exec(select(VersionScore).order_by(col(VersionScore.version), col(VersionScore.name))).all()
    return [(row.version, row.name, row.mean) for row in rows]


def ingested(ctx: PanelContext, *records: dict[str, Any]) -> None:
    with ctx.db.session() as session:
        ingest.ingest_eval(session, RUN, "local", list(records))
        session.commit()


def test_the_poller_ingests_each_evaluation_once_and_a_version_scored_again_adds_nothing(panel: Panel) -> None:
    store = LocalStore(panel.ctx.folder.parent / "store")
    first = ChunkWriter(store, RUN, "eval")
    first.add(record(0, 0.2, digit_frac=0.2))
    first.add(record(5, 0.6, digit_frac=0.6))
    first.flush()
    resumed = ChunkWriter(store, RUN, "eval")  # a resumed trainer: scores v5 again, then v10
    resumed.add(record(5, 0.9, digit_frac=0.9))
    resumed.add(record(10, 0.7, digit_frac=0.7))
    resumed.flush()
    store.put_bytes(layout.telemetry_key(RUN, "eval", resumed.seq), encode_jsonl([record(10, 0.1)]))  # a 2nd writer

    assert Poller(panel.ctx).poll_run(RUN) == 3
    expected = [(0, "reward", 0.2), (0, "rewards/digit_frac", 0.2), (5, "reward", 0.6), (5, "rewards/digit_frac", 0.6),
                (10, "reward", 0.7), (10, "rewards/digit_frac", 0.7)]  # fmt: skip
    assert scores(panel.ctx) == expected
    restarted = PanelContext(Database(panel.ctx.db.path), panel.ctx.folder)
    try:
        assert Poller(restarted).poll_run(RUN) == 0  # the cursor moved past every chunk: nothing read twice
    finally:
        restarted.db.close()
    assert scores(panel.ctx) == expected


def test_records_that_cannot_be_placed_are_left_out_and_unbounded_intervals_kept_as_none() -> None:
    records = [
        record(3, 0.5, half=None),
        {**record(4, 0.5), "key": ""},
        {**record(5, 0.5), "version": "5"},
        {**record(6, 0.5), "step": None},
        {**record(7, 0.5), "scores": ["reward"]},
        {**record(8, 0.5), "scores": {"reward": {"mean": math.nan}, "rewards/x": 0.5, "rewards/y": {"mean": 1}}},
        {**record(9, 0.5), "prompts": None, "time": math.inf},
    ]
    rows = ingest.eval_rows(RUN, "local", records)
    assert [(row["version"], row["name"]) for row in rows] == [(3, "reward"), (8, "rewards/y"), (9, "reward")]
    assert (rows[0]["low"], rows[0]["high"], rows[0]["pass_at_k"]) == (None, None, None)
    assert rows[2]["prompts"] == 0 and math.isfinite(rows[2]["time"])


def test_the_series_and_the_best_version_come_from_the_runs_own_evaluation(panel: Panel) -> None:
    ingested(panel.ctx, record(5, 0.9, key="after0run0key000"))  # an earlier evaluation under other settings
    ingested(panel.ctx, record(0, 0.2, half=None), record(3, 0.6), record(5, 0.81), record(9, 0.81), record(7, 0.4))
    queries = QueryService(panel.ctx, "local")
    series = queries.held_out_series(RUN)
    assert [(s.version, s.step, s.mean) for s in series] == [(0, 0, 0.2), (3, 2, 0.6), (5, 4, 0.81), (7, 6, 0.4),
                                                             (9, 8, 0.81)]  # fmt: skip
    assert (series[0].low, series[0].half_width) == (None, None)
    assert series[1].half_width == pytest.approx(0.05)
    assert queries.best_by_eval(RUN) == HeldOutScore(5, 4, 0.81, 0.81 - 0.05, 0.81 + 0.05)  # the earlier of a tie
    assert queries.held_out_series(RUN, "rewards/nothing") == []
    assert queries.held_out_count(RUN) == 6
    with pytest.raises(RunNotFound):
        QueryService(panel.ctx, "someone-else").best_by_eval(RUN)


def test_a_run_without_evaluation_has_no_series_and_no_best(panel: Panel) -> None:
    queries = QueryService(panel.ctx, "local")
    assert (queries.held_out_series(RUN), queries.best_by_eval(RUN), queries.held_out_count(RUN)) == ([], None, 0)


def test_a_deleted_run_takes_its_held_out_scores_with_it(panel: Panel) -> None:
    ingested(panel.ctx, record(0, 0.2), record(3, 0.6))
    runs = RunService(panel.ctx, "local")
    runs.delete(RUN)  # a draft: deletable
    assert scores(panel.ctx) == []


def test_the_chart_draws_the_held_out_reward_with_intervals_beside_the_training_reward() -> None:
    reward = [HeldOutScore(0, 0, 0.2, None, None), HeldOutScore(5, 4, 0.6, 0.5, 0.7)]
    training = [(step, step / 10) for step in range(1, 9)]
    functions = {"digits": reward, "length": [HeldOutScore(0, 0, 0.1, 0.0, 0.2), HeldOutScore(5, 4, 0.3, 0.2, 0.4)]}
    figure = held_out_figure(reward, training, functions, ChartOptions(smoothing=1))
    names = [trace.name for trace in figure.data]
    assert names == ["training reward per step", "held-out reward", "held-out digits", "held-out length"]
    held = figure.data[1]
    assert (list(held.x), list(held.y)) == ([0, 4], [0.2, 0.6])
    assert list(held.error_y.array) == [None, pytest.approx(0.1)]
    assert list(held.error_y.arrayminus) == [None, pytest.approx(0.1)]
    assert list(figure.data[0].x) == list(range(1, 9))
    assert figure.data[2].error_y.array is None  # per function: the means only, to stay readable

    one_reward = held_out_figure(reward, training, {"digits": reward}, ChartOptions(smoothing=4))
    assert [trace.name for trace in one_reward.data] == ["training reward, rolling mean (4 steps)", "held-out reward"]
    # An eval metric (scored, never trained on) always has its trace, even beside a single reward.
    with_metric = held_out_figure(reward, training, {"digits": reward}, metrics={"exact": functions["length"]})
    assert [trace.name for trace in with_metric.data][1:] == ["held-out reward", "held-out metric exact"]
    assert list(with_metric.data[2].y) == [0.1, 0.3]
    by_time = held_out_figure(reward, training, options=ChartOptions(log_y=True, x_values={4: 30.0}, x_title="t"))
    assert list(by_time.data[1].x) == [0, 4] and by_time.layout.yaxis.type == "log"
    assert by_time.layout.xaxis.title.text.startswith("optimizer step")

    empty = held_out_figure([], training)
    assert not empty.data and "No held-out evaluation yet" in empty.layout.annotations[0].text


def test_the_monitor_redraws_the_evaluation_chart_when_scores_arrive_and_names_the_best_version(panel: Panel) -> None:
    page = MonitorPage(panel)
    with gr.Blocks():
        page.build()

    def tick(drawn: dict[str, Any]) -> dict[Any, Any]:
        return page.refresh(RUN, "training", drawn, 1, True, "", "", "", "", False, 1, "", 0, False, "step", [])

    first = tick({})
    assert not first[page.eval_plot].data and "best by eval" not in first[page.header]
    assert page.eval_plot not in tick(first[page.drawn])  # nothing new: nothing redrawn
    ingested(panel.ctx, record(0, 0.2), record(5, 0.812))  # no other telemetry: the run row is unchanged
    second = tick(first[page.drawn])
    held = second[page.eval_plot].data[-1]
    assert held.name == "held-out reward" and list(held.y) == [0.2, 0.812]
    assert "<span>best by eval</span><b>v5 (0.812)</b>" in second[page.header]


def test_a_tick_redraws_the_training_charts_when_the_chart_controls_arrive_after_the_first_drawing(
    panel: Panel,
) -> None:
    """After a reload the browser's saved chart controls may reach the page after the Monitor's first drawing; the
    next tick draws with them, even though the run (stopped, say) logged nothing new."""
    page = MonitorPage(panel)
    with gr.Blocks():
        page.build()
    filters = ("", "", "", "", False, 1, "")
    first = page.refresh(RUN, "training", {}, 1, True, *filters, 0, False, "step", [])
    assert page.more_plot in first
    same = page.refresh(RUN, "training", first[page.drawn], 1, True, *filters, 0, False, "step", [])
    assert page.more_plot not in same
    restored = page.refresh(RUN, "training", first[page.drawn], 1, True, *filters, 1, True, "step", ["loss"])
    assert page.more_plot in restored and page.reward_plot in restored


def test_the_header_shows_the_best_version_by_eval_only_when_there_is_one(panel: Panel) -> None:
    run = RunService(panel.ctx, "local").get(RUN)
    assert "best by eval" not in cards.run_header(run, None)
    header = cards.run_header(run, None, best_by_eval=HeldOutScore(7, 6, 0.8123, 0.7, 0.9))
    assert "<span>best by eval</span><b>v7 (0.812)</b>" in header


def test_the_versions_table_shows_held_out_rewards_and_the_best_by_eval_is_offered_first(panel: Panel) -> None:
    """Issue 29: once versions are evaluated the `best` alias goes by held-out reward, not the training reward (v3
    trained best here), and an ended run's version picker offers it first, preselected for make current, branch and
    publish."""
    with panel.ctx.db.session() as session:
        session.add_all(
            AdapterVersion(run_id=RUN, owner="local", version=v, step=v - 1, created_at=time.time(), reward=v / 10)
            for v in (1, 2, 3)
        )
        session.commit()
    ingested(panel.ctx, record(0, 0.9), record(1, 0.25, half=None), record(2, 0.5, half=0.04), record(3, 0.3))
    alerts.evaluate(panel.ctx.db, RUN)
    run = RunService(panel.ctx, "local").get(RUN)
    assert run.best_version == 2  # v0 scored higher, but the base model is no version to keep
    page = AdaptersPage(panel)
    with gr.Blocks():
        page.build()
    shown = page.show_run(RUN)
    table = shown[page.table]
    assert list(zip(table["version"], table[HELD_OUT_COLUMN], table["alias"], strict=True)) == [
        ("v3", "0.300 ± 0.050", ""),
        ("v2", "0.500 ± 0.040", "★ best"),
        ("v1", "0.250 ± ∞", ""),
    ]
    picker = shown[page.version]
    assert picker.choices[0] == ("v2 · step 1 · best by eval", 2) and picker.value != 2  # a draft: current offered
    with panel.ctx.db.session() as session:
        ended = session.get(Run, RUN)
        assert ended is not None
        ended.status = "finished"
        session.add(ended)
        session.commit()
    assert page.show_run(RUN)[page.version].value == 2


def test_versions_to_evaluate_are_named_by_number_last_all_every_nth_or_best_training_reward(panel: Panel) -> None:
    """Issue 29: the Adapters page, the command line and the API take the same words for the versions to evaluate;
    `every:N` picks as the run's own evaluation does (v1, the base model's weights, left out) and adds the last."""
    from backend.services.evaluation import EvaluationError, EvaluationService

    service = EvaluationService(panel.ctx, "local")
    with pytest.raises(EvaluationError, match="has no version yet; 'last' names none"):
        service.versions_named(RUN, ["last"])
    assert service.versions_named(RUN, ["0"]) == [0]
    rewards = {version: (0.9 if version == 17 else version / 100) for version in range(1, 26)}
    with panel.ctx.db.session() as session:
        session.add_all(
            AdapterVersion(run_id=RUN, owner="local", version=v, step=v - 1, created_at=time.time(), reward=reward)
            for v, reward in rewards.items()
        )
        session.commit()
    assert service.versions_named(RUN, ["every:10"]) == [11, 21, 25]
    assert service.versions_named(RUN, ["0", "every:10", "best-reward", "last", "11"]) == [0, 11, 21, 25, 17]
    assert service.versions_named(RUN, ["all"]) == list(range(26))
    for words, said in [
        (["every:0"], "'every:0' needs a whole number of versions from 1 up"),
        (["every:x"], "'every:x' needs a whole number"),
        (["best"], "'best' is not a version; give numbers (0: the base model), last, all, every:N or best-reward"),
        ([], "name at least one version"),
    ]:
        with pytest.raises(EvaluationError, match=re.escape(said)):
            service.versions_named(RUN, words)


def test_the_best_of_an_evaluation_is_an_adapter_version_as_the_alias_is() -> None:
    """The base model often scores well on a shaped reward early on; it is marked best only when nothing else was
    evaluated, as the `best` alias never names it."""
    from app.pages.adapters import best_evaluated
    from jobs.evaluation.results import VersionEval

    def result(version: int, score: float) -> VersionEval:
        scores = {"reward": [[score, score]]}
        return VersionEval(RUN, version, KEY, "split 'test'", {}, 2, ["p"], [["a", "b"]], scores, 1.0)

    assert best_evaluated([result(0, 0.9), result(3, 0.2), result(5, 0.4)]).version == 5
    assert best_evaluated([result(0, 0.9)]).version == 0
