"""`python -m app`: the panel's web server, with the background poller that keeps every run's data current.

Locally it serves http://127.0.0.1:7860 for the single local owner; in a Hugging Face Space (SPACE_ID or
SYSTEM=spaces) it binds 0.0.0.0:7860 and signs users in with Hugging Face OAuth. The poller runs in a thread of this
process: ingestion never depends on a page being open. With GRPO_PANEL_SNAPSHOTS set, the database is restored from
its snapshot there when the local copy is missing, and snapshotted every few minutes and on shutdown (SIGTERM
included: a Space is stopped with it) (backend/database/snapshots.py).
"""

from __future__ import annotations

import logging
import os
import signal
from types import FrameType

from app.panel import Panel
from app.theme import CSS, HEAD, theme
from app.ui import build_app
from backend import settings
from backend.context import PanelContext
from backend.database.connection import default_db_path
from backend.database.snapshots import Snapshots, restore_snapshot, snapshot_folder
from backend.hosting import on_space
from backend.ingestion.poller import Poller
from jobs.secrets import install_log_redaction

DEFAULT_PORT = 7860


def bind_address(space: bool) -> tuple[str, int]:
    """0.0.0.0 in a Space (its proxy must reach us), loopback elsewhere unless GRADIO_SERVER_NAME says otherwise."""
    host = "0.0.0.0" if space else settings.SERVER_NAME.get() or "127.0.0.1"
    return host, int(settings.SERVER_PORT.get() or DEFAULT_PORT)


def main() -> None:
    install_log_redaction()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    space = on_space()
    host, port = bind_address(space)
    snapshots_to = snapshot_folder()
    if snapshots_to is not None:
        restore_snapshot(default_db_path(), snapshots_to)
    ctx = PanelContext()
    snapshots = Snapshots(ctx.db.path, snapshots_to).start() if snapshots_to is not None else None
    signal.signal(signal.SIGTERM, _interrupt)  # a stop runs the `finally` below: the last snapshot is written
    poller = Poller(ctx).start()
    app = build_app(Panel(ctx, space))
    app.queue(default_concurrency_limit=8)
    print(
        f"GRPO control panel: http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}  (data in {ctx.folder})",
        flush=True,
    )
    try:
        app.launch(
            server_name=host,
            server_port=port,
            theme=theme(),
            css=CSS,
            head=HEAD,
            show_error=True,
            footer_links=["gradio"],
            quiet=True,
        )
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (`_interrupt`): a clean stop
        pass
    finally:
        poller.stop()
        if snapshots is not None:
            snapshots.stop()


def _interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt
