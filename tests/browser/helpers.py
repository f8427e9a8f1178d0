"""What the browser tests share: timeouts, screenshots, and how to reach Gradio's widgets from Playwright."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from playwright.sync_api import Locator, Page

from backend.database.connection import PROJECT_ROOT

ARTIFACTS = PROJECT_ROOT / "artifacts"
SCREENSHOTS = ARTIFACTS / "screenshots"
TIMEOUT_MS = 30_000


@dataclass
class RunningPanel:
    """The panel process under test: where to open it, its data folder and its log."""

    url: str
    data: Path
    log: Path


def screenshot(page: Page, name: str) -> Path:
    """A full-page screenshot under artifacts/screenshots/ (kept as a test artifact, and looked at)."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    time.sleep(0.5)  # let plotly finish its transitions
    # A long page redrawn every second, beside a training run on two cores, can take longer to capture than an
    # interaction is given; still frames (no CSS animations) and a longer limit keep the artifact from failing a test.
    page.screenshot(path=str(path), full_page=True, animations="disabled", timeout=3 * TIMEOUT_MS)
    return path


def browser_errors(page: Page) -> list[str]:
    """The console errors and uncaught exceptions of `page` from now on (a list that fills as they come): what a
    failed wait prints, so that a page that stopped updating says whether its scripts failed."""
    errors: list[str] = []
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: errors.append(f"uncaught: {error}"))
    return errors


def run_row(panel: RunningPanel, run_id: str) -> str:
    """The run's status, step and last telemetry as the panel's database holds them (read-only, beside the panel):
    tells a page that stopped refreshing from a poller that stopped ingesting."""
    with sqlite3.connect(f"file:{panel.data / 'panel.sqlite3'}?mode=ro", uri=True, timeout=30) as db:
        row = db.execute(
            "SELECT status, step, started_at, last_telemetry_at FROM run WHERE id = ?", (run_id,)
        ).fetchone()
    return f"(status, step, started at, last telemetry at) {row}, now {time.time():.0f}"


def fill(page: Page, elem_id: str, value: str) -> None:
    """Type into a Textbox or Number by its elem_id (its input sits inside the wrapper div)."""
    page.locator(f"#{elem_id}").locator("textarea, input").first.fill(value)


def open_tab(page: Page, name: str) -> None:
    page.get_by_role("tab", name=name, exact=True).click()


def rows(page: Page, elem_id: str, has_text: str | re.Pattern | None = None) -> Locator:
    """The rows of a Gradio table (a virtual grid: rows are role=row elements, the first one is the header)."""
    return page.locator(f"#{elem_id} [role=row]", has_text=has_text)


def plot_points(page: Page, elem_id: str) -> int:
    """How many x values the first trace of a plotly figure holds (0 while it shows its empty state)."""
    return page.evaluate(
        """id => { const g = document.querySelector(`#${id} .js-plotly-plot`);
                   return g && g.data && g.data.length && g.data[0].x ? g.data[0].x.length : 0 }""",
        elem_id,
    )


def browser_state(page: Page, storage_key: str, secret: str) -> object:
    """A `gr.BrowserState`'s value as this browser keeps it (None: nothing kept). Gradio stores it encrypted with
    CryptoJS: AES-256-CBC, its key and IV derived OpenSSL-style (MD5, a random salt) from the secret's SHA-256 hex.
    A test reads it to wait for the browser to have kept a choice before it reloads the page."""
    stored = page.evaluate("key => window.localStorage.getItem(key)", storage_key)
    if not stored:
        return None
    raw = base64.b64decode(stored.split(":", 1)[1])
    assert raw[:8] == b"Salted__", "not CryptoJS's OpenSSL format"
    salt, body = raw[8:16], raw[16:]
    password = hashlib.sha256(secret.encode()).hexdigest().encode()
    derived, block = b"", b""
    while len(derived) < 48:
        block = hashlib.md5(block + password + salt).digest()
        derived += block
    decryptor = Cipher(algorithms.AES(derived[:32]), modes.CBC(derived[32:48])).decryptor()
    padded = decryptor.update(body) + decryptor.finalize()
    return json.loads(padded[: -padded[-1]])
