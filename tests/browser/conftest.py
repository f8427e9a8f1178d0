"""The real panel (`python -m app`) on a loopback port, and Debian's Chromium driven by Playwright.

The panel runs as its own process with its data in a temporary folder, exactly as a user starts it; the tests talk to
it only through the browser. At teardown the panel is stopped, then every job a test left running is cancelled through
the panel's own launcher, so no trainer or replica outlives the suite.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from backend.database.connection import PROJECT_ROOT, Database
from jobs.ports import free_port
from tests.browser.helpers import ARTIFACTS, TIMEOUT_MS, RunningPanel
from tests.support.net import wait_http

CHROMIUM = "/usr/bin/chromium"
expect.set_options(timeout=TIMEOUT_MS)  # 2 shared cores: Gradio's first paint alone can take seconds


def _model_cache() -> str:
    """One tiny-model cache for every test and run (building it is the slowest part of a first demo)."""
    return os.environ.get("GRPO_MODEL_CACHE") or str(Path.home() / ".cache" / "grpo-panel" / "models")


def _cancel_leftover_jobs(data: Path) -> None:
    """Cancel, through the panel's own services and launcher, every job still running in this panel's data folder."""
    from backend.context import PanelContext
    from backend.launchers.base import TERMINAL
    from backend.services.runs import RunService

    ctx = PanelContext(Database(data / "panel.sqlite3"), folder=data)
    runs = RunService(ctx, "local")
    for run in runs.list():
        for job in runs.jobs(run.id):
            handle = ctx.handle(job)
            if ctx.launcher_for(run).state(handle).stage not in TERMINAL:
                ctx.launcher_for(run).cancel(handle)
    ctx.db.close()


@contextmanager
def running_panel(
    name: str, extra_env: dict[str, str] | None = None, seed: Callable[[Path], None] | None = None
) -> Iterator[RunningPanel]:
    """`python -m app` on a loopback port with a data folder of its own (`seed` may fill it first), stopped and its
    leftover jobs cancelled afterwards; its log is kept as artifacts/<name>.log."""
    # Its own folder, not pytest's tmp_path: pytest prunes old session folders, and other suites on this machine
    # must not be able to delete a data folder the panel is still writing to.
    folder = Path(tempfile.mkdtemp(prefix="grpo-panel-browser-"))
    port = free_port()
    env = {
        **os.environ,
        "GRPO_PANEL_DATA": str(folder / "data"),
        "GRPO_MODEL_CACHE": _model_cache(),
        "GRADIO_SERVER_PORT": str(port),
        "GRADIO_TEMP_DIR": str(folder / "gradio"),
        "GRADIO_ANALYTICS_ENABLED": "False",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "NO_PROXY": "127.0.0.1,localhost",
    }
    for variable in ("SPACE_ID", "SYSTEM", "GRADIO_SERVER_NAME"):
        env.pop(variable, None)
    env.update(extra_env or {})
    if seed is not None:
        seed(folder / "data")
    log = folder / "panel.log"
    with open(log, "wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "app"],
            cwd=PROJECT_ROOT,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_http(url, timeout=90)
        yield RunningPanel(url=url, data=folder / "data", log=log)
    finally:
        # The panel first (so it starts no new job), then whatever jobs it left running.
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        try:
            _cancel_leftover_jobs(folder / "data")
        finally:
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            shutil.copy(log, ARTIFACTS / f"{name}.log")  # the panel's own log, for a failed run's post-mortem
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def panel() -> Iterator[RunningPanel]:
    # Nothing listens at that address: the panel meets the Hub as on a machine offline, the same on every machine.
    with running_panel("browser-panel", {"HF_ENDPOINT": "http://127.0.0.1:9"}) as running:
        yield running


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--disable-gpu"])
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Browser, panel: RunningPanel) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(panel.url)
    expect(page.locator("#tab-launch, [role=tab]").first).to_be_visible()
    yield page
    context.close()
