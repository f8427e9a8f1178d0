"""An agent run's episodes on the Monitor's Samples tab, turn by turn, in a real browser (issue 31, part 4).

The browser suite trains no run (a real one is tests/test_e2e_demo.py's), so the agent run's trainer is stood in for:
its bucket is written as a trainer writes one — the spec, then rollout samples through `jobs.telemetry.ChunkWriter`,
each episode's `turns` and completion made from TRL's messages by the trainer's own `episode_turns` and
`episode_text` — and the run is added to the panel with `python -m backend import`, as a user adds the runs a bucket
holds. Episodes written after that are ingested by the panel's own poller, as during a run; a final trainer status
ends the run, as a trainer does.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, expect

from backend.database.connection import PROJECT_ROOT
from jobs.contract import layout
from jobs.demo.preset import demo_spec
from jobs.runtime import write_status
from jobs.store import LocalStore
from jobs.telemetry import ChunkWriter
from jobs.trainer.episode_loop import TURN_VERSION
from jobs.trainer.telemetry import episode_text, episode_turns
from tests.browser.helpers import RunningPanel, fill, open_tab, rows, screenshot

pytestmark = pytest.mark.browser
RUN = "agent-episodes"
MARKUP = '<img id="xss-turn" src="x" onerror="document.title=\'pwned\'">'


# An episode's messages as TRL hands them to the trainer: each reply marked with the version that generated it.
def _call(content: str, expression: str, version: int) -> dict[str, Any]:
    call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": expression}}}
    return {"role": "assistant", "content": content, "tool_calls": [call], TURN_VERSION: version}


def _answer(content: str, version: int) -> dict[str, Any]:
    return {"role": "assistant", "content": content, TURN_VERSION: version}


def _tool(content: str) -> dict[str, Any]:
    return {"role": "tool", "name": "calculate", "content": content}


def _episode(step: int, group: int, messages: list[dict[str, Any]], reward: float) -> dict[str, Any]:
    """A sample record as the trainer writes an agent's episode (jobs/trainer/telemetry.py's RecordingQueue): its
    turns and its completion as the trainer's own functions make them. Every episode starts on v1; the trainer's
    version when it takes them is the step's."""
    return {
        "step": step,
        "time": time.time(),
        "attempt": 1,
        "policy_version": 1,
        "staleness": step - 1,
        "dropped": False,
        "group_id": group,
        "prompt": f"user: What is {group + 3} + 4?",
        "completion": episode_text(messages),
        "reward": reward,
        "rewards": {"correct": reward},
        "advantage": reward - 0.5,
        "turns": episode_turns(messages, agent=True),
    }


def _write(store: LocalStore, *records: dict[str, Any]) -> None:
    """One chunk of samples and each step's reward, as the trainer's telemetry writes them."""
    samples, metrics = ChunkWriter(store, RUN, "samples"), ChunkWriter(store, RUN, "metrics")
    for record in records:
        samples.add(record)
    for step in sorted({record["step"] for record in records}):
        metrics.add({"step": step, "time": time.time(), "attempt": 1, "reward": 0.5})
    assert samples.flush() and metrics.flush()


@pytest.fixture(scope="module")
def agent_run(panel: RunningPanel) -> Iterator[LocalStore]:
    """The agent run imported into the panel with its first step; the store to write the rest of it into."""
    folder = Path(tempfile.mkdtemp(prefix="grpo-panel-agent-"))
    store = LocalStore(folder)
    spec = demo_spec(RUN, f"file://{folder}", environment={"kind": "builtin", "name": "calculator"}, eval={})
    store.put_bytes(layout.spec_key(RUN), spec.to_json().encode())
    _write(
        store,
        _episode(1, 0, [_call("I will compute it.", "3+4", 1), _tool("7"), _answer("7", 1)], 1.0),
        _episode(1, 0, [_answer("8", 1)], 0.0),
    )
    imported = subprocess.run(
        [sys.executable, "-m", "backend", "import", f"file://{folder}"],
        cwd=PROJECT_ROOT,
        env={**os.environ, "GRPO_PANEL_DATA": str(panel.data)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert imported.returncode == 0 and RUN in imported.stdout, imported.stderr
    yield store
    shutil.rmtree(folder, ignore_errors=True)


def test_an_agent_episode_is_shown_turn_by_turn_with_the_version_of_each_turn(
    page: Page, agent_run: LocalStore
) -> None:
    # Written after the import: the panel's own poller ingests it. The last turn came from v2, after a weight sync.
    synced = [_call(f"Adding {MARKUP}", "4+4", 1), _tool("8"), _answer("The answer is 8.", 2)]
    _write(agent_run, _episode(2, 1, synced, 1.0), _episode(2, 1, [_answer("9", 1)], 0.0))
    open_tab(page, "Monitor")
    page.locator("#monitor-run input").click()
    page.get_by_role("option", name=re.compile(RUN)).click()
    expect(page.locator("#run-header")).to_contain_text(RUN)
    open_tab(page, "Samples")
    best = page.locator("#best-sample")
    expect(best).to_contain_text("Best of group 1", timeout=60_000)  # step 2, once the poller has ingested it
    expect(best).to_contain_text("episode: 3 turns, 1 tool call")
    turns = best.locator(".gp-turn-head")
    expect(turns).to_have_text(
        ["turn 1 · model · v1", "turn 2 · tool calculate answered", "turn 3 · model · v2 (after a sync)"]
    )
    expect(best.locator(".gp-tool-call")).to_have_text(re.compile(r"→ calls calculate\s*expression = 4\+4"))
    expect(best.locator(".gp-turn-tool")).to_contain_text("8")
    expect(best).to_contain_text("episode reward 1.000")
    expect(best).to_contain_text(MARKUP)  # the model's text shown as text, never run as markup
    expect(page.locator("#xss-turn")).to_have_count(0)
    assert page.title() != "pwned"
    expect(page.locator("#worst-sample .gp-turn-head")).to_have_text(["turn 1 · model · v1"])
    screenshot(page, "monitor-episode")
    _find_episodes(page)
    _end_the_run(agent_run, page)


def _find_episodes(page: Page) -> None:
    """Every step, only the episodes of three turns or more; with version 2, only the one it had a turn in; a count
    of turns that cannot be used lists nothing and says why."""
    page.get_by_label("Follow the latest step").uncheck()
    page.locator("#sample-all-steps input").check()
    count = page.locator("#sample-count")
    expect(count).to_contain_text("Samples 1–4 of 4")
    fill(page, "sample-turns", "3")
    page.locator("#sample-turns").locator("textarea, input").first.press("Enter")
    expect(count).to_contain_text("Samples 1–2 of 2")
    fill(page, "sample-version", "v2")
    page.locator("#sample-version").locator("textarea, input").first.press("Enter")
    expect(count).to_contain_text("Samples 1–1 of 1")
    expect(rows(page, "samples-table").nth(1)).to_contain_text("The answer is 8.")
    fill(page, "sample-version", "")
    fill(page, "sample-turns", "many")
    page.locator("#sample-turns").locator("textarea, input").first.press("Enter")
    expect(count).to_contain_text("Episode turns ≥: “many” is not a number of turns")
    expect(rows(page, "samples-table")).to_have_count(1)  # the header alone
    fill(page, "sample-turns", "")
    page.locator("#sample-turns").locator("textarea, input").first.press("Enter")
    expect(count).to_contain_text("Samples 1–4 of 4")
    rows(page, "samples-table").nth(4).locator("[role=gridcell]").first.click()  # step 1's group
    expect(page.locator("#best-sample")).to_contain_text("Best of group 0")
    expect(page.locator("#best-sample .gp-turn-head")).to_have_text(
        ["turn 1 · model · v1", "turn 2 · tool calculate answered", "turn 3 · model · v1"]
    )


def _end_the_run(store: LocalStore, page: Page) -> None:
    """The trainer's last status ends the run, so the panel's other tests find only their own runs going."""
    write_status(store, RUN, "trainer", {"phase": "finished", "step": 2, "max_steps": 2, "attempt": 1})
    expect(page.locator("#run-header")).to_contain_text("finished", timeout=60_000)
