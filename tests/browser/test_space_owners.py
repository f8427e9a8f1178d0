"""Two signed-in users on one panel hosted as a Space: neither sees, stops, downloads or branches the other's runs.

The panel runs as a Space runs it (`SPACE_ID`, `SYSTEM=spaces`, Gradio's real OAuth routes). Signing in is faked the
only way a test can: each browser context carries the session cookie Gradio's OAuth callback would have set for that
user (signed with the Space's OAuth secret, as Starlette's session middleware signs it). Alice owns a run with two
adapter versions, Bob a draft. Each sees only their own on every page, a visitor sees nothing, and Bob's session,
sending the page's own events with Alice's run in them (what a user editing the page's requests would do), gets an
error and changes nothing of hers. Gradio refuses those first (a run id that is not among the choices his session
was given); the owner check behind it is driven directly with Bob's profile in tests/test_security.py
(`test_bob_can_neither_read_nor_change_alices_run_from_any_page`), and the public API's side, with Hub tokens, there
too (`test_through_the_api_bob_gets_nothing_of_alices_...`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import itsdangerous
import pytest
import requests
from playwright.sync_api import Browser, Page, expect
from sqlmodel import select

from backend.context import PanelContext
from backend.database.connection import Database
from backend.database.models import AdapterVersion, Run
from backend.ingestion.poller import Poller
from backend.services.runs import RunService
from jobs.contract import layout
from jobs.demo.preset import demo_spec
from jobs.store import LocalStore
from jobs.store.published import publish_directory
from jobs.telemetry import ChunkWriter
from tests.browser.conftest import running_panel
from tests.browser.helpers import TIMEOUT_MS, RunningPanel, open_tab, rows

pytestmark = pytest.mark.browser
ALICE, BOB = "alice", "bob"
ALICE_RUN, BOB_RUN = "alice-run", "bob-draft"
OAUTH_SECRET = "space-oauth-secret-for-tests"
SPACE_ENV = {
    "SPACE_ID": "tester/grpo-panel",
    "SYSTEM": "spaces",  # what Gradio reads to use its real OAuth routes
    "OAUTH_CLIENT_ID": "space-oauth-client",
    "OAUTH_CLIENT_SECRET": OAUTH_SECRET,
    "OAUTH_SCOPES": "openid profile jobs-api",
    "OPENID_PROVIDER_URL": "http://127.0.0.1:9",  # never reached: nobody goes through the login redirect
    "HF_ENDPOINT": "http://127.0.0.1:9",  # nothing here may reach the real Hub
}


def markup(where: str) -> str:
    """Markup that, were it rendered instead of shown as text, would add an element with a known id and run script."""
    return f'<img id="xss-{where}" src="x" onerror="document.title=\'pwned\'">'


def _seed(data: Path) -> None:
    """Alice's run with adapter versions 1 and 2 in its bucket and two steps of metrics, samples and an error event
    (ingested by the poller, as after training), and Bob's draft, in the panel's database before it starts. Her run's
    name, sample text, reward name and error carry markup."""
    ctx = PanelContext(Database(data / "panel.sqlite3"), data)
    store_root = data.parent / "buckets"
    RunService(ctx, ALICE).create(demo_spec(ALICE_RUN, f"file://{store_root / ALICE}", name=markup("name")))
    RunService(ctx, BOB).create(demo_spec(BOB_RUN, f"file://{store_root / BOB}"))
    store = LocalStore(store_root / ALICE)
    metrics, samples, events = (ChunkWriter(store, ALICE_RUN, stream) for stream in ("metrics", "samples", "events"))
    for step in (1, 2):
        metrics.add({"step": step, "time": time.time(), "attempt": 1, "reward": step / 4, "ratio": 1.0})
        for index in range(4):
            samples.add(
                {
                    "step": step,
                    "policy_version": step,
                    "staleness": 0,
                    "group_id": step,
                    "prompt": markup("prompt"),
                    "completion": markup("completion"),
                    "reward": index / 4,
                    "rewards": {markup("reward"): index / 4},
                    "advantage": 0.1,
                    "attempt": 1,
                }
            )
    events.add({"kind": "error", "level": "error", "time": time.time(), "message": "S3 said: " + markup("error")})
    for writer in (metrics, samples, events):
        writer.flush()
    for version in (1, 2):
        adapter = data.parent / f"adapter-{version}"
        adapter.mkdir()
        (adapter / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
        (adapter / "adapter_model.safetensors").write_bytes(b"\0" * (64 * version))
        publish_directory(store, layout.adapter_prefix(ALICE_RUN, version), adapter, {"version": version, "step": 5})
    Poller(ctx).poll_run(ALICE_RUN)
    ctx.db.close()


def session_cookie(username: str) -> str:
    """The `session` cookie Gradio's OAuth callback sets for a signed-in Hub user, signed with the Space's secret."""
    now = int(time.time())
    oauth_info = {
        "access_token": f"hf_oauth_{username}_{secrets.token_hex(8)}",
        "token_type": "bearer",
        "expires_in": 8 * 3600,
        "expires_at": now + 8 * 3600,
        "scope": SPACE_ENV["OAUTH_SCOPES"],
        "userinfo": {
            "sub": hashlib.sha256(username.encode()).hexdigest()[:24],
            "name": username.title(),
            "preferred_username": username,
            "profile": f"https://huggingface.co/{username}",
            "picture": "",
            "website": "",
        },
    }
    key = hashlib.sha256(f"{OAUTH_SECRET}-v4".encode()).hexdigest()  # as gradio.oauth.attach_oauth derives it
    payload = base64.b64encode(json.dumps({"oauth_info": oauth_info}).encode())
    return itsdangerous.TimestampSigner(key).sign(payload).decode()


@pytest.fixture(scope="module")
def space_panel() -> Iterator[RunningPanel]:
    with running_panel("space-panel", SPACE_ENV, seed=_seed) as running:
        yield running


def _page(browser: Browser, panel: RunningPanel, username: str | None) -> Page:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    if username is not None:
        context.add_cookies([{"name": "session", "value": session_cookie(username), "url": panel.url}])
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(panel.url)
    expect(page.get_by_role("tab", name="Runs", exact=True)).to_be_visible()
    return page


def _dropdown_options(page: Page, elem_id: str) -> list[str]:
    page.locator(f"#{elem_id} input").click()
    options = page.locator("ul[role=listbox] li[role=option]")
    texts = [options.nth(index).inner_text() for index in range(options.count())]
    page.keyboard.press("Escape")
    return texts


def test_each_signed_in_user_sees_only_their_own_runs_and_a_visitor_none(browser: Browser, space_panel):
    alice = _page(browser, space_panel, ALICE)
    open_tab(alice, "Runs")
    expect(rows(alice, "runs-table", ALICE_RUN)).to_have_count(1)
    expect(rows(alice, "runs-table", BOB_RUN)).to_have_count(0)
    open_tab(alice, "Adapters")
    # The tab's answer brings the run list and the run it opens together: wait for it, then read the list.
    expect(alice.locator("#adapters-run input")).to_have_value(re.compile(ALICE_RUN))  # her only run, opened
    assert any(ALICE_RUN in option for option in _dropdown_options(alice, "adapters-run"))
    expect(rows(alice, "versions-table").nth(2)).to_be_visible()  # a header and her two versions

    bob = _page(browser, space_panel, BOB)
    open_tab(bob, "Runs")
    expect(rows(bob, "runs-table", BOB_RUN)).to_have_count(1)
    expect(rows(bob, "runs-table", ALICE_RUN)).to_have_count(0)
    for tab, elem_id in (("Adapters", "adapters-run"), ("Monitor", "monitor-run")):
        open_tab(bob, tab)
        expect(bob.locator(f"#{elem_id} input")).to_have_value(re.compile(BOB_RUN))  # the list has come: his run
        options = _dropdown_options(bob, elem_id)
        assert any(BOB_RUN in option for option in options) and not any(ALICE_RUN in o for o in options), options

    visitor = _page(browser, space_panel, None)
    open_tab(visitor, "Runs")
    expect(rows(visitor, "runs-table", re.compile(f"{ALICE_RUN}|{BOB_RUN}"))).to_have_count(0)
    for page in (alice, bob, visitor):
        page.context.close()


class PageEvents:
    """A signed-in session sending the page's own events over Gradio's queue, with inputs of its choosing."""

    def __init__(self, url: str, username: str):
        self.url = url
        self.http = requests.Session()
        self.http.cookies.set("session", session_cookie(username))
        config = self.http.get(url + "config", timeout=30).json()
        self.components = {component["id"]: component for component in config["components"]}
        self.ids = {c.get("props", {}).get("elem_id"): c["id"] for c in config["components"]}
        self.dependencies = config["dependencies"]

    def click(self, button: str, **inputs: Any) -> dict:
        """Send the click event of the button with elem_id `button`, its inputs (by elem_id) as given, the others at
        their initial values; the queue's final message."""
        target = self.ids[button]
        event = next(d for d in self.dependencies if [target, "click"] in d["targets"])
        data = []
        for component_id in event["inputs"]:
            props = self.components[component_id].get("props", {})
            data.append(inputs.get(str(props.get("elem_id", "")).replace("-", "_"), props.get("value")))
        session_hash = secrets.token_hex(6)
        joined = self.http.post(
            self.url + "gradio_api/queue/join",
            json={"data": data, "fn_index": event["id"], "session_hash": session_hash, "trigger_id": target},
            timeout=30,
        )
        assert joined.status_code == 200, joined.text
        with self.http.get(
            self.url + "gradio_api/queue/data", params={"session_hash": session_hash}, stream=True, timeout=60
        ) as stream:
            for line in stream.iter_lines():
                if line.startswith(b"data:"):
                    message = json.loads(line[5:])
                    if message.get("msg") == "process_completed":
                        return message
        raise AssertionError(f"no answer to {button}")


def _alices_state(data: Path) -> list[tuple]:
    db = Database(data / "panel.sqlite3")
    try:
        with db.session() as session:
            runs = session.exec(select(Run.id, Run.owner, Run.status, Run.current_version).order_by(Run.id)).all()
            versions = session.exec(select(AdapterVersion.run_id, AdapterVersion.version)).all()
    finally:
        db.close()
    return [tuple(row) for row in runs] + [tuple(row) for row in versions]


@pytest.mark.parametrize(
    ("button", "inputs"),
    [
        ("prepare-download", {"adapters_run": ALICE_RUN, "adapters_version": 1}),
        ("make-current", {"adapters_run": ALICE_RUN, "adapters_version": 1}),
        ("branch", {"adapters_run": ALICE_RUN, "adapters_version": 1, "branch_id": "bob-steals", "branch_now": False}),
        ("compare", {"adapters_run": ALICE_RUN, "compare_a": 1, "compare_b": 2}),
        ("stop-run", {"monitor_run": ALICE_RUN}),
    ],
)
def test_bobs_session_sending_alices_run_in_the_pages_events_gets_nothing_and_changes_nothing(
    space_panel, button, inputs
):
    before = _alices_state(space_panel.data)
    answer = PageEvents(space_panel.url, BOB).click(button, **inputs)
    assert answer["success"] is False, answer
    # Refused by the owner check, or before it by Gradio (a run that is not one of his choices).
    refusal = re.compile(f"no run '{ALICE_RUN}'|{ALICE_RUN}.{{0,20}} is not in the list of choices")
    assert refusal.search(json.dumps(answer)), answer
    assert _alices_state(space_panel.data) == before
    assert not list((space_panel.data / "downloads").glob(f"*/{ALICE_RUN}*"))


def test_markup_in_names_samples_rewards_and_errors_is_shown_as_text(browser: Browser, space_panel):
    """What users and services wrote (a run's name, rollout text, a reward's name, an error from the bucket) is shown
    literally on every page: no element it describes appears and no script of it runs."""
    page = _page(browser, space_panel, ALICE)
    injected = page.locator("[id^=xss-]")
    open_tab(page, "Runs")
    expect(rows(page, "runs-table", ALICE_RUN)).to_contain_text('<img id="xss-name"')
    open_tab(page, "Monitor")
    expect(page.locator("#monitor-run input")).to_have_value(re.compile(ALICE_RUN))
    expect(page.locator("body")).to_contain_text('<img id="xss-error"')
    page.get_by_role("tab", name="Samples", exact=True).click()
    expect(rows(page, "samples-table").nth(1)).to_contain_text('<img id="xss-completion"')
    expect(page.locator("body")).to_contain_text('<img id="xss-prompt"')
    expect(page.locator("body")).to_contain_text('<img id="xss-reward"')
    open_tab(page, "Adapters")
    expect(rows(page, "versions-table").nth(2)).to_be_visible()
    for tab in ("Runs", "Monitor", "Adapters"):
        open_tab(page, tab)
        expect(injected).to_have_count(0)
    assert page.title() != "pwned"
    page.context.close()
