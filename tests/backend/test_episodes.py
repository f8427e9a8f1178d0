"""Agent episodes turn by turn (issue 31, part 4): a sample's `turns` as the trainer records them are ingested (checked,
cut to size, never stopping ingest), found by the version that generated any turn and by their number of turns,
returned by the API, exported nested, and shown on the Monitor's sample cards turn by turn, escaped."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd
import pyarrow.parquet as pq
import pytest
from alembic import command
from sqlalchemy import create_engine
from sqlmodel import col, select

from app import cards
from app.pages.monitor import MonitorPage
from app.panel import Panel
from app.public_api import PublicApi
from backend.context import PanelContext
from backend.database import schema
from backend.database.connection import Database
from backend.database.models import RolloutSample
from backend.database.turns import ToolCall, Turn, read_turns
from backend.ingestion import ingest
from backend.ingestion.episodes import CUT, MAX_EPISODE_CHARS, stored_turns
from backend.ingestion.poller import Poller
from backend.services.exports import ExportService
from backend.services.queries import QueryService, SampleFilters
from backend.services.runs import RunService
from jobs.demo.preset import demo_spec
from jobs.store import LocalStore
from jobs.telemetry import ChunkWriter
from jobs.trainer.episode_loop import TURN_VERSION
from jobs.trainer.telemetry import episode_turns

RUN = "demo-agent"
MARKUP = '<img id="xss-turn" src="x" onerror="document.title=\'pwned\'">'


def _reply(content: str, version: int, *calls: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    """A reply as TRL's message list holds it, marked by the rollout loop with the version that generated it."""
    tool_calls = [{"type": "function", "function": {"name": name, "arguments": args}} for name, args in calls]
    return {"role": "assistant", "content": content, "tool_calls": tool_calls, TURN_VERSION: version}


def _recorded(*messages: dict[str, Any]) -> list[dict[str, Any]]:
    """An episode's `turns` as the trainer records them, by its own `episode_turns`: what it records changing
    reaches these tests."""
    turns = episode_turns(list(messages), agent=True)
    assert turns is not None  # an agent run records every episode turn by turn
    return turns


# The calculator episode of the brief: v5 calls a tool, a weight sync lands, v6 answers.
SYNCED = _recorded(
    _reply(f"Let me add 3 and 4. {MARKUP}", 5, ("calculate", {"expression": "3+4"})),
    {"role": "tool", "name": "calculate", "content": "7"},
    _reply("7", 6),
)
# An episode that never called a tool: one model turn, by the version it started on.
DIRECT = _recorded(_reply("7, without a tool", 5))


@pytest.fixture
def panel(tmp_path: Path) -> Iterator[Panel]:
    ctx = PanelContext(Database(tmp_path / "panel.sqlite3"), tmp_path / "panel")
    spec = demo_spec(RUN, f"file://{tmp_path / 'store'}", environment={"kind": "builtin"}, eval={})
    RunService(ctx, "local").create(spec)
    yield Panel(ctx, space=False)
    ctx.db.close()


def sample(
    group: int, turns: Any, reward: float, policy_version: int = 5, step: int = 1, **fields: Any
) -> dict[str, Any]:
    """A sample record as the trainer writes it; `turns` None leaves the key out (a single reply)."""
    record: dict[str, Any] = {
        "step": step,
        "time": time.time(),
        "attempt": 1,
        "policy_version": policy_version,
        "staleness": 1,
        "dropped": False,
        "group_id": group,
        "prompt": "user: What is 3 + 4?",
        "completion": f"completion of group {group}",
        "reward": reward,
        "rewards": {"correct": reward},
        "advantage": 0.5,
        **fields,
    }
    if turns is not None:
        record["turns"] = turns
    return record


def poll(panel: Panel, *records: dict[str, Any]) -> None:
    """`records` written to the run's store as one telemetry chunk, then ingested by the poller."""
    store = LocalStore(Path(panel.ctx.folder).parent / "store")
    writer = ChunkWriter(store, RUN, "samples")
    for record in records:
        writer.add(record)
    assert writer.flush()
    Poller(panel.ctx).poll_run(RUN)


def rows(panel: Panel) -> list[RolloutSample]:
    with panel.ctx.db.session() as session:
        return list(session.exec(select(RolloutSample).order_by(col(RolloutSample.id))).all())


def agent_samples(panel: Panel) -> None:
    """Group 0: the synced episode (reward 1) and the direct one (0); group 1: a single reply by v6."""
    poll(panel, sample(0, SYNCED, 1.0), sample(0, DIRECT, 0.0), sample(1, None, 0.5, policy_version=6))


def test_the_poller_keeps_an_episodes_turns_and_a_single_reply_has_none(panel: Panel) -> None:
    agent_samples(panel)
    synced, direct, single = rows(panel)
    assert read_turns(synced.turns_json) == [
        Turn("assistant", f"Let me add 3 and 4. {MARKUP}", None, [ToolCall("calculate", {"expression": "3+4"})], 5),
        Turn("tool", "7", "calculate"),
        Turn("assistant", "7", version=6),
    ]
    assert read_turns(direct.turns_json) == [Turn("assistant", "7, without a tool", version=5)]
    assert single.turns_json is None and read_turns(single.turns_json) is None
    assert single.completion == "completion of group 1"  # the rest of a sample as before


def test_the_api_returns_an_episodes_turns_and_null_for_a_single_reply(panel: Panel) -> None:
    agent_samples(panel)
    listed = PublicApi(panel).run_samples(RUN)["samples"]
    by_group = {(s["group_id"], s["reward"]): s["turns"] for s in listed}
    assert by_group[(1, 0.5)] is None
    assert by_group[(0, 1.0)] == [
        {
            "role": "assistant",
            "content": f"Let me add 3 and 4. {MARKUP}",
            "name": None,
            "tool_calls": [{"name": "calculate", "arguments": {"expression": "3+4"}}],
            "version": 5,
        },
        {"role": "tool", "content": "7", "name": "calculate", "tool_calls": [], "version": None},
        {"role": "assistant", "content": "7", "name": None, "tool_calls": [], "version": 6},
    ]
    json.dumps(listed)  # what Gradio sends


@pytest.mark.parametrize(
    "turns",
    ["not a list", 7, {"role": "assistant"}, [], [1, "turn", None, {}, {"role": 3}, {"role": ""}]],
    ids=["text", "number", "object", "empty", "nothing-like-a-turn"],
)
def test_turns_that_hold_no_turn_are_a_single_reply(turns: Any) -> None:
    assert stored_turns(turns) is None


def test_malformed_fields_are_coerced_or_dropped_and_never_stop_ingest(panel: Panel, tmp_path: Path) -> None:
    """A record from a job over the network may hold anything: what is not a turn is left out, a field of the wrong
    type is coerced (a text) or dropped (a version, a tool's name), and the rest of the chunk is ingested."""
    turns = [
        "not a turn",
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "parts"}],  # content parts, as some templates hold them
            "tool_calls": [
                {"function": {"name": "calculate", "arguments": '{"expression": "2*'}},  # OpenAI's form, unparsed
                {"name": "calculate", "arguments": 12},
                {"name": "calculate"},
                {"arguments": {"x": 1}},  # no tool named: not a call
                "calculate(1)",
            ],
            "version": "6",
        },
        {"role": "tool", "name": 5, "content": None, "tool_calls": "none", "version": True},
        {"role": "assistant", "content": "", "version": 10**30},  # beyond 64 bits: an unknown version
        {"role": "assistant", "content": "nan", "tool_calls": [{"name": "f", "arguments": {"x": float("nan")}}]},
    ]
    poll(panel, sample(0, turns, 1.0), sample(1, None, 0.0, policy_version=6))
    episode, single = rows(panel)
    assert read_turns(episode.turns_json) == [
        Turn(
            "assistant",
            '[{"type": "text", "text": "parts"}]',
            None,
            [ToolCall("calculate", '{"expression": "2*'), ToolCall("calculate", "12"), ToolCall("calculate", {})],
        ),
        Turn("tool", ""),
        Turn("assistant", ""),
        Turn("assistant", "nan", None, [ToolCall("f", '{"x": NaN}')]),  # kept as text: SQLite refuses NaN in JSON
    ]
    assert single.turns_json is None
    queries = QueryService(panel.ctx, "local")
    assert queries.count_samples(RUN, SampleFilters(version=6)) == 1  # json_each reads every stored episode
    _, parquet = ExportService(panel.ctx, "local").export(RUN, "parquet", tmp_path)
    assert len(pq.read_table(parquet).column("turns").to_pylist()[0]) == 4


def test_an_episodes_texts_are_cut_to_size_each_cut_marked(panel: Panel) -> None:
    long = "x" * (MAX_EPISODE_CHARS - 10)
    turns = [
        {"role": "assistant", "content": long, "tool_calls": [{"name": "run_python", "arguments": {"code": "y" * 50}}]},
        {"role": "tool", "name": "run_python", "content": "z" * 100},
        {"role": "assistant", "content": "never kept", "version": 2},
    ]
    kept = read_turns(stored_turns(turns))
    assert kept is not None
    assert [turn.content for turn in kept] == [long, CUT, CUT]
    assert kept[0].tool_calls == [ToolCall("run_python", '{"code": "' + CUT)]  # 10 characters of its JSON were left
    assert kept[2].version == 2  # what is cut is text: the turns, their roles and versions stay
    assert len(stored_turns(turns) or "") < MAX_EPISODE_CHARS + 1000


def test_the_version_filter_finds_an_episode_by_any_of_its_turns_and_the_turn_filter_finds_episodes(
    panel: Panel,
) -> None:
    agent_samples(panel)
    poll(panel, sample(2, SYNCED, 0.25, step=2, policy_version=4))  # started on v4: v5 and v6 wrote its turns
    queries = QueryService(panel.ctx, "local")

    def found(**filters: Any) -> list[tuple[int, int, float | None]]:
        listed = queries.samples(RUN, **filters)
        assert queries.count_samples(RUN, SampleFilters(**filters)) == len(listed)
        return [(s.step, s.group_id, s.reward) for s in listed]

    assert found(version=6) == [(2, 2, 0.25), (1, 0, 1.0), (1, 1, 0.5)]  # a turn after a sync, a single reply
    assert found(version=5) == [(2, 2, 0.25), (1, 0, 1.0), (1, 0, 0.0)]
    assert found(version=4) == [(2, 2, 0.25)]  # the version the episode started on
    assert found(version=7) == []
    assert found(min_turns=1) == [(2, 2, 0.25), (1, 0, 1.0), (1, 0, 0.0)]  # every episode, no single reply
    assert found(min_turns=3) == [(2, 2, 0.25), (1, 0, 1.0)]
    assert found(min_turns=4) == []
    assert found(min_turns=3, version=4) == [(2, 2, 0.25)]
    assert found(step_from=1, step_to=1, min_turns=3, version=6) == [(1, 0, 1.0)]


def test_the_samples_tab_filters_by_turns_and_refuses_a_number_it_cannot_use(panel: Panel) -> None:
    agent_samples(panel)
    page = MonitorPage(panel)
    with gr.Blocks():
        page.build()

    def completions(turns: str, version: str = "") -> list[str]:
        table = page.browse(RUN, 1, "", "", "", version, True, 1, turns)[page.samples]
        return list(table["completion"])

    assert completions("") == ["completion of group 0", "completion of group 0", "completion of group 1"]
    assert completions("3") == ["completion of group 0"]
    assert completions("1", "v6") == ["completion of group 0"]  # the synced episode; the single reply is no episode
    for typed, said in (("x", "Episode turns ≥: “x” is not a number of turns"), ("0", "“0” is below 1")):
        refused = page.browse(RUN, 1, "", "", "", "", True, 1, typed)
        assert said in refused[page.sample_count] and refused[page.samples].empty


def test_exports_hold_an_episode_in_one_row_its_turns_nested_in_parquet_and_json_in_csv(
    panel: Panel, tmp_path: Path
) -> None:
    agent_samples(panel)
    exports = ExportService(panel.ctx, "local")
    expected = [
        {
            "role": "assistant",
            "content": f"Let me add 3 and 4. {MARKUP}",
            "name": None,
            "tool_calls": [{"name": "calculate", "arguments": '{"expression": "3+4"}'}],
            "version": 5,
        },
        {"role": "tool", "content": "7", "name": "calculate", "tool_calls": [], "version": None},
        {"role": "assistant", "content": "7", "name": None, "tool_calls": [], "version": 6},
    ]
    _, parquet = exports.export(RUN, "parquet", tmp_path / "parquet")
    table = pq.read_table(parquet)
    assert table.num_rows == 3
    assert str(table.schema.field("turns").type) == (
        "list<element: struct<role: string, content: string, name: string, "
        "tool_calls: list<element: struct<name: string, arguments: string>>, version: int64>>"
    )
    turns = table.column("turns").to_pylist()
    assert turns[0] == expected and turns[1][0]["content"] == "7, without a tool" and turns[2] is None
    assert pd.read_parquet(parquet)["reward/correct"].tolist() == [1.0, 0.0, 0.5]
    _, csv = exports.export(RUN, "csv", tmp_path / "csv")
    read = pd.read_csv(csv, keep_default_na=False)
    assert json.loads(read["turns"][0]) == expected and read["turns"][2] == ""
    assert read["completion"].tolist() == ["completion of group 0"] * 2 + ["completion of group 1"]


def test_exports_of_single_replies_keep_the_turns_column_typed(panel: Panel, tmp_path: Path) -> None:
    """A run without any episode still has the column, of the same type: files of two runs concatenate."""
    poll(panel, sample(0, None, 1.0))
    _, parquet = ExportService(panel.ctx, "local").export(RUN, "parquet", tmp_path)
    assert pq.read_table(parquet).schema.field("turns").type.value_type.names == [
        "role",
        "content",
        "name",
        "tool_calls",
        "version",
    ]


def test_a_picked_groups_cards_show_each_episode_turn_by_turn_with_its_versions_escaped(panel: Panel) -> None:
    agent_samples(panel)
    page = MonitorPage(panel)
    with gr.Blocks():
        page.build()
    table = page.browse(RUN, 1, "", "", "", "", True)[page.samples]
    picked = page.pick_group(RUN, table, gr.SelectData(None, {"index": [1, 0], "value": 1, "selected": True}))
    best, worst = picked[page.best], picked[page.worst]
    assert "Best of group 0" in best and "started on v5 (1 behind the trainer)" in " ".join(best.split())
    assert "episode: 3 turns, 1 tool call" in best
    headings = [re.sub(r"<[^>]+>", "", h) for h in re.findall(r'<div class="gp-turn-head">(.*?)</div>', best)]
    assert headings == ["turn 1 · model · v5", "turn 2 · tool calculate answered", "turn 3 · model · v6 (after a sync)"]
    assert '<span class="gp-synced">v6 (after a sync)</span>' in best
    assert '→ calls <b>calculate</b><pre class="gp-text">expression = 3+4</pre>' in best
    assert '<pre class="gp-text">7</pre>' in best  # the tool's answer
    assert "episode reward <b>1.000</b>" in best
    assert MARKUP not in best and "&lt;img id=&quot;xss-turn&quot;" in best  # the model's text, never markup
    assert "episode: 1 turn, 0 tool calls" in worst and "turn 1 · model · v5" in worst


def test_a_single_reply_card_is_as_before_and_an_unknown_version_or_role_is_said(panel: Panel) -> None:
    poll(
        panel,
        sample(0, None, 0.5),
        sample(1, [{"role": "assistant", "content": "hi"}, {"role": "<user>", "content": "more"}], 0.0),
    )
    single, episode = rows(panel)
    shown = cards.sample_card("One", single)
    assert "generated by v5 (1 behind the trainer)" in " ".join(shown.split())
    completion = '<pre class="gp-text gp-completion">completion of group 0</pre>'
    assert f'<div class="gp-label">completion</div>{completion}' in shown
    assert "gp-turn" not in shown
    shown = cards.sample_card("Two", episode)
    assert "turn 1 · model · version unknown" in shown and "turn 2 · &lt;user&gt;" in shown
    assert "gp-completion" not in shown  # the episode replaces the flattened completion


def test_a_database_of_the_previous_release_gains_the_turns_column_at_start_up(tmp_path: Path) -> None:
    """A panel at revision 0005 with a sample: opening it adds the column, keeps the sample (a single reply), and
    episodes ingest into it."""
    path = tmp_path / "panel.sqlite3"
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as connection:
        command.upgrade(schema._config(connection), "0005")
        connection.exec_driver_sql(
            "INSERT INTO run (id, owner, name, status, status_message, spec_json, storage_uri, backend, "
            "created_at, step, max_steps, cost_usd) "
            "VALUES ('kept', 'alice', '', 'finished', '', '{}', 'file:///x', 'local', 0, 40, 40, 0)"
        )
        connection.exec_driver_sql(
            "INSERT INTO rolloutsample (run_id, owner, step, policy_version, staleness, group_id, prompt, "
            "completion, rewards_json, advantage, dropped, attempt) "
            "VALUES ('kept', 'alice', 1, 1, 0, 0, 'p', 'c', '{}', 0, 0, 1)"
        )
    engine.dispose()
    db = Database(path)
    try:
        with db.session() as session:
            ingest.ingest_samples(session, "kept", "alice", [sample(1, SYNCED, 1.0)])
            session.commit()
            kept, episode = session.exec(select(RolloutSample).order_by(col(RolloutSample.id))).all()
        assert (kept.completion, kept.turns_json) == ("c", None)
        turns = read_turns(episode.turns_json)
        assert turns is not None and [turn.version for turn in turns] == [5, None, 6]
    finally:
        db.close()
